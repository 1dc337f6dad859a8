"""jaxact's benchmark suite: `python -m benchmarks [--quick] [--out DIR]`.

Measures jaxact against jax.nn in one run on this machine and writes `results.md` to `--out`.
"""
