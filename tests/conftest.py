"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import os

# The tests are CPU tests (Pallas kernels in interpret mode, lowering and compiling for abstract
# GPUs). With jax's CUDA plugin loaded (for tests/test_gpu_compile.py), a process that may use CUDA
# makes the plugin look for a driver; on CPU only, it registers just its compiler.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpreter runs each warpgroup as an XLA CPU program whose callbacks block at
# barriers until the other warpgroups arrive, on XLA's CPU thread pool: one thread a core unless
# NPROC says otherwise. On a 2-core machine two waiting warpgroups could hold both threads while
# the third (the one they wait for) never starts: the kernel hangs.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

import jax

from jaxact._src import test_util

jax.config.update("jax_enable_x64", True)
test_util.use_gpu_compiler()  # before the first computation starts jax's backends


def pytest_make_parametrize_id(config, val, argname):
  """Stable ids for callables (xdist's workers must collect the same names; a default id holds a
  memory address): a function's name, a partial's function and keywords."""
  import functools

  if isinstance(val, functools.partial):
    keywords = ",".join(f"{k}={v}" for k, v in val.keywords.items())
    return f"partial({getattr(val.func, '__name__', type(val.func).__name__)},{keywords})"
  if callable(val) and not isinstance(val, type):
    return getattr(val, "__name__", None) or type(val).__name__
  return None
