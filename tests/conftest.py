"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import os

# The tests are CPU tests (Pallas kernels in interpret mode, lowering and compiling for abstract
# GPUs). With jax's CUDA plugin loaded (for tests/test_gpu_compile.py), a process that may use CUDA
# makes the plugin look for a driver; on CPU only, it registers just its compiler.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from jaxact._src import test_util

jax.config.update("jax_enable_x64", True)
test_util.use_gpu_compiler()  # before the first computation starts jax's backends
