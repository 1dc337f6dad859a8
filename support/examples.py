"""The Flax examples the tests keep (``tests/<name>.py``: Flax's lm1b and ImageNet models written
after the examples), loaded by path for the benchmarks, which may not import the tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name: str) -> types.ModuleType:
  """``tests/<name>.py`` as the module `name` (once: the tests' own import finds it)."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
  assert spec is not None and spec.loader is not None, name
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
