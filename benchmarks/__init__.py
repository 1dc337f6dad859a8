"""jaxact's measurements, one command line: `python -m benchmarks [JOB] [options]`.

Without a job, the main job (`benchmarks.suite`): `python -m benchmarks [--quick] [--out DIR]`
writes DIR/rows.jsonl, DIR/results.md rendered from them and the frontier pictures;
`python -m benchmarks --help` lists every job. Laid out as: one module a family declaring its
cases (`activations`, `fused`, `gated`, `norms`, `lce`, `decoder`, `attention`, `codes`, ...),
what the jobs share in `benchmarks.harness` (timing, compiled memory, frontier, plots, rows and
their rendering), each job's tables drawn from its rows in `benchmarks.tables` (pure Python:
`python -m benchmarks render` redraws the results pages' blocks from committed rows), the GPU jobs
in `benchmarks.gpu`.
"""
