"""Dump the optimized HLO of one bf16 layer's training step per path (for reading buffer use).

python -m benchmarks hlo OUT_DIR [M K N]
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from support import layer_paths, layer_step


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  out = argv[0]
  m, k, n = (int(v) for v in argv[1:4]) if len(argv) >= 4 else (8192, 4096, 4096)
  os.makedirs(out, exist_ok=True)
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
  for name in ("relu", "gelu"):
    for path, f in layer_paths(name).items():
      compiled = layer_step(f).lower(*args).compile()
      fname = f"{name}-{path.replace(' ', '_').replace('.', '')}.hlo.txt"
      with open(os.path.join(out, fname), "w") as fh:
        fh.write(compiled.as_text())
      print(fname, compiled.memory_analysis().temp_size_in_bytes / 2**20, "MiB temp")
  return 0
