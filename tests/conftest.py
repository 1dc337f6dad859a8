"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import os

# The tests are CPU tests (Pallas kernels in interpret mode, lowering for abstract GPUs). With jax's
# CUDA plugin installed (the test extra brings it, for tests/test_gpu_compile.py), a process that
# may use CUDA makes the plugin look for a driver; on CPU only, it registers just its compiler.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_enable_x64", True)
