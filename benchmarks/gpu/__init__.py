"""The GPU jobs: `python -m benchmarks gpu` (sections; `--truth`, the prepared run of a short
GPU loan), the main job's GPU section (`suite`), an HLO dump (`python -m benchmarks hlo`)."""
