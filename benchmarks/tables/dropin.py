"""The dropin job's tables from its rows (sections ``dropin`` and ``activation``)."""

from __future__ import annotations

from benchmarks.harness import render


def _cells(f: dict) -> list[str]:
  alone = f"{f['ratio_vs_no_dropout']:.3f}" if f["dropout"] else "1"
  return [
    f["stack"],
    f["model"],
    str(f["dropout"]),
    f"{f['temp_bytes'] / 2**20:.1f}",
    f"{f['ratio_vs_flax']:.3f}",
    alone,
    f"{f['step_ratio_vs_flax']:.2f}",
  ]


HEADER = ("stack", "model", "dropout", "temp MiB", "/ flax", "/ itself without dropout")
TABLE = render.Table((*HEADER, "step time / flax"), _cells)  # section "dropin"


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints, from its rows: the table, then the activation given as a function."""
  lines: list[str] = []
  measured = [r for r in rows if r["section"] == "dropin"]
  if measured and section in (None, "dropin"):
    f, m = measured[0]["figures"], measured[0]["meta"]
    lines += [
      f"{f['blocks']} blocks, {f['tokens']} tokens, D = {f['dim']}, mlp_dim = {f['mlp_dim']}, "
      f"CPU float32, jax {m.get('jax')}.",
      "",
      *TABLE.lines(measured),
    ]
  for r in rows:
    if r["section"] == "activation" and section in (None, "activation"):
      f = r["figures"]
      lines += [
        *([""] if lines else []),
        f'`activation=nn.relu` against `"relu"` (unrolled, dropout 0.1): '
        f"{f['by_fn_bytes'] / 2**20:.1f} and {f['named_bytes'] / 2**20:.1f} MiB of temp.",
      ]
  return lines
