"""The aot job's tables from its rows (sections ``memory``, ``mlp``, ``compile``, ``spills``: a
row a case, ``benchmarks.harness.sections``' way)."""

from __future__ import annotations


def memory(rows: list[dict]) -> list[str]:
  lines = [
    f"One bf16 layer's step (y, dx, dw, db) compiled for an {rows[0]['device']}: XLA's temp, MiB "
    "(its default gemms / cuBLAS's).",
    "",
    "| M, K, N | activation | path | temp | temp, cuBLAS gemms | kernels |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    (m, k, n), temps = r["shape"], r["temp_MiB"]
    lines.append(
      f"| {m}, {k}, {n} | {r['activation']} | {r['path']} | {temps[0]:.0f} | {temps[1]:.0f} | "
      f"{', '.join(r['kernels']) or '-'} |"
    )
  return lines


def mlp(rows: list[dict]) -> list[str]:
  f = rows[0]
  lines = [
    f"MLP {f['layers']} x ({f['m']}, {f['d']}) x ({f['d']}, {f['d']}) bf16, jit(value_and_grad), "
    f"compiled for an {f['device']}: XLA's temp, MiB.",
    "",
    "| activation | path | temp | temp, cuBLAS gemms |",
    "|---|---|---|---|",
  ]
  for r in rows:
    temps = r["temp_MiB"]
    lines.append(f"| {r['activation']} | {r['path']} | {temps[0]:.0f} | {temps[1]:.0f} |")
  return lines


def compile_(rows: list[dict]) -> list[str]:
  lines = [
    "| kernel, activation, shape | GPU | compiles | custom calls / error |",
    "|---|---|---|---|",
  ]
  for c in rows:
    lines.append(f"| {c['what']} | {c['gpu']} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |")
  return lines


def spills(rows: list[dict]) -> list[str]:
  total = sum(len(r["spilling"]) for r in rows)
  lines = [
    f"{len(rows)} tile configurations x every elementwise activation; {total} (configuration, "
    "activation) pairs spill registers:",
    "",
    "| GPU | kernel | (M, K, N) or channels | dtype | tiles | spilling activations |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    if r["spilling"]:
      lines.append(
        f"| {r['gpu']} | {r['kernel']} | {tuple(r['shape'])} | {r['dtype']} | {r['tiles']} | "
        f"{', '.join(r['spilling'])} |"
      )
  return lines


DRAW = {"memory": memory, "mlp": mlp, "compile": compile_, "spills": spills}


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section under its heading (`section` alone: its
  table without the heading)."""
  if section is not None:
    return DRAW[section]([r["figures"] for r in rows if r["section"] == section])
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    these = [r["figures"] for r in rows if r["section"] == name]
    lines += ["", f"### {name}", "", *DRAW[name](these)]
  return lines
