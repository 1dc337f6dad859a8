"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import collections
import os
import sys

# CI's environment sets PYTHONDONTWRITEBYTECODE: every process of the suite (the workers, the
# 8-device scripts, the notebook's kernel, the docs build) would compile jax's and flax's sources
# anew (`import jax, flax.nnx, optax`: 8 s, against 2.5 s from cached bytecode). The first process
# to import a module caches it for the others.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The tests are CPU tests (Pallas kernels in interpret mode, lowering and compiling for abstract
# GPUs). With jax's CUDA plugin loaded (for tests/core/test_gpu_compile.py), a process that may use
# CUDA makes the plugin look for a driver; on CPU only, it registers just its compiler.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpreter runs each warpgroup as an XLA CPU program whose callbacks block at
# barriers until the other warpgroups arrive, on XLA's CPU thread pool: one thread a core unless
# NPROC says otherwise. On a 2-core machine two waiting warpgroups could hold both threads while
# the third (the one they wait for) never starts: the kernel hangs.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))
# The suite's programs are small: compiling them costs more than running them. LLVM's expensive
# passes off (XLA's HLO passes, fusion and buffer assignment, which the memory tests read, still
# run); here and in every subprocess the tests start (8-device scripts, notebooks, the docs build).
# support.compile_for restores the full backend optimization for the GPU compiles (spill checks).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402 (after the environment above)
import pytest  # noqa: E402

import support  # noqa: E402
import support.tpu  # noqa: E402

jax.config.update("jax_enable_x64", True)
support.use_gpu_compiler()  # before the first computation starts jax's backends
support.tpu.use_tpu_compiler()


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


# The default suite's budget: under 8 minutes on the 2-core CI machine, install included. A survey
# (a parametrized test) declares its default sample beside its parametrization:
# `@pytest.mark.sample(n)` runs `n` of its cases by default (those not marked exhaustive already),
# spread evenly over its collection order, the first always, and `sample(n, id, ...)` those cases
# too (by their ids, for a corner no other default case names); `@pytest.mark.exhaustive` none.
# `pytest -m exhaustive` runs every case. tests/repo/test_layout.py checks that every activation,
# dtype and option a sampled-out case names is still named by some case of the default run. (The
# kernel surveys name their default cases instead, with `cases.representatives(cases, default)`.)
SAMPLE_COVERAGE = pytest.StashKey[dict]()


def _token(value) -> str | None:
  """What a parameter value names, for the coverage check: an activation, dtype, option or
  function name; None for numbers, shapes and other values that name nothing."""
  import functools

  import numpy as np

  if isinstance(value, bool) or value is None:
    return None
  if isinstance(value, str):
    return value
  if isinstance(value, np.dtype) or (isinstance(value, type) and hasattr(value, "dtype")):
    try:  # numpy's and jax.numpy's scalar types; a class with a `dtype` attribute is no dtype
      return np.dtype(value).name
    except (TypeError, ValueError):
      return value.__name__
  if hasattr(value, "name") and isinstance(value.name, str) and hasattr(value, "residual"):
    return value.name  # an ActivationSpec
  if isinstance(value, functools.partial):
    return _token(value.func)
  if callable(value) and not isinstance(value, type):
    return getattr(value, "__name__", None)
  return None


def tokens(item) -> set[str]:
  """The names a case's parameters give (activations, dtypes, options, case names)."""
  spec = getattr(item, "callspec", None)
  if spec is None:
    return set()
  return {t for v in spec.params.values() if (t := _token(v)) is not None}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Mark the cases each `sample(n)` leaves out as exhaustive (before `-m` deselects by marks), and
  stash what the default run names against what only the sampled-out cases name."""
  groups = collections.defaultdict(list)
  for item in items:
    marker = item.get_closest_marker("sample")
    if marker is not None and not item.get_closest_marker("exhaustive"):
      groups[item.nodeid.split("[")[0]].append((item, marker.args))
  sampled_out = []
  for key, group in groups.items():
    n, *named = group[0][1]
    ids = [item.callspec.id for item, _ in group]
    if set(named) - set(ids):
      raise pytest.UsageError(f"{key}: sample() names no such case: {set(named) - set(ids)}")
    keep = {round(i * len(group) / n) for i in range(min(n, len(group)))}
    keep |= {ids.index(name) for name in named}
    for i, (item, _) in enumerate(group):
      if i not in keep:
        item.add_marker(pytest.mark.exhaustive)
        sampled_out.append(item)
  default = [item for item in items if not item.get_closest_marker("exhaustive")]
  named_by_default = set().union(*(tokens(item) for item in default))
  config.stash[SAMPLE_COVERAGE] = {
    "files": {str(item.path) for item in items},
    "uncovered": {
      t: item.nodeid for item in sampled_out for t in tokens(item) if t not in named_by_default
    },
  }
