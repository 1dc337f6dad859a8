"""The main job, `python -m benchmarks [--quick] [--out DIR]`: jaxact against jax.nn, Flax and
Flax + remat.

Measures everything in one run on this machine, with a progress bar on stderr; writes its rows
to DIR/rows.jsonl, renders from them DIR/results.md (markdown tables, machine and versions) and
PNG figures in DIR, and prints the summary table. Its centre is the memory-time frontier of each
model (MLP and CNN, relu and gelu; a scanned gated MLP stack; an LM decoder step): every way a
user could train it (Flax, Flax under each remat policy, jaxact, jaxact with few-bit codes,
jaxact under the same remat policies), each point's compiled temp memory and step time measured
in the same run, one picture per model (DIR/frontier_<model>.png) and, per model, jaxact's best
step time at Flax + remat's memory or less and jaxact's least memory at Flax's step time or less.
`python -m benchmarks activations` runs the activation sections alone. On a GPU the suite also
times the fused layers and the activations against their peak bandwidth and throughput
(benchmarks/gpu/suite.py). What `--quick` leaves out: `benchmarks.suite.measure`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None, job: str = "main") -> int:
  from benchmarks.__main__ import usage

  parser = argparse.ArgumentParser(
    prog="python -m benchmarks" + ("" if job == "main" else f" {job}"),
    usage="python -m benchmarks [JOB] [options]" if job == "main" else None,
    description=" ".join(__doc__.split("\n\n")[0].split()),
    epilog=usage() if job == "main" else None,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="fewer timing rounds and activations, same memory figures (about 5 min on 2 cores)",
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder"
  )
  parser.add_argument(
    "--from-rows", type=pathlib.Path, default=None, help="measure nothing: render these rows"
  )
  args = parser.parse_args(argv)
  from benchmarks.harness import rows
  from benchmarks.suite import figures, report

  rec = rows.current()
  rec.path = args.out / ("rows.jsonl" if job == "main" else f"{job}.rows.jsonl")
  if args.from_rows is None:
    from benchmarks.suite import measure

    measure.measure(rec, args.quick, activations_only=job == "activations")
    rec.write()
  else:
    rec.written = True
  run = report.Run(rows.read(args.from_rows or rec.path))
  args.out.mkdir(parents=True, exist_ok=True)
  names = figures.write_figures(run, args.out)
  page = args.out / ("results.md" if job == "main" else f"{job}.md")
  page.write_text(report.render(run, names, (args.from_rows or rec.path).name))
  print(report.summary(run))
  t = run.time
  print(
    f"\nfull tables in {page}, figures in {args.out}/*.png, rows in "
    f"{args.from_rows or rec.path} ({t['seconds']:.0f} s, {t['cpu_seconds']:.0f} s of CPU)",
    file=sys.stderr,
  )
  return 0
