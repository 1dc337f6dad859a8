"""The repository's boundaries: benchmarks consume the library; only the library is installed."""

from __future__ import annotations

import ast
import pathlib
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imported_modules(source: str, top_level_only: bool = False) -> set[str]:
  """Dotted names of the modules `source` imports (relative imports excluded)."""
  tree = ast.parse(source)
  nodes = tree.body if top_level_only else ast.walk(tree)
  names = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
  return names


def _sources(*folders: str) -> list[pathlib.Path]:
  return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _top(name: str) -> str:
  return name.split(".")[0]


def test_the_import_walk_sees_every_form_of_import():
  source = "import benchmarks.aot\nfrom benchmarks import gpu\ndef f():\n  import benchmarks\n"
  assert imported_modules(source) == {"benchmarks.aot", "benchmarks"}
  assert imported_modules(source, top_level_only=True) == {"benchmarks.aot", "benchmarks"}
  assert imported_modules("from . import x\nimport os.path") == {"os.path"}


@pytest.mark.parametrize("folder", ["jaxact", "pallas_kernels", "tests"])
def test_nothing_outside_benchmarks_imports_them(folder):
  files = _sources(folder)
  assert files
  offenders = [
    f"{p.relative_to(ROOT)}: {name}"
    for p in files
    for name in imported_modules(p.read_text())
    if _top(name) == "benchmarks"
  ]
  assert offenders == [], "benchmarks/ consumes the library; nothing may import it"


def test_no_test_module_imports_another():
  """Shared test helpers live in helper modules (cases.py, kernel_cases.py, ...) or in
  jaxact._src.test_util, never in a test module."""
  tests = {p.stem for p in _sources("tests") if p.stem.startswith("test_")}
  offenders = [
    f"{p.relative_to(ROOT)}: {name}"
    for p in _sources("tests")
    for name in imported_modules(p.read_text())
    if name.split(".")[-1] in tests
  ]
  assert offenders == []


def test_test_util_imports_only_jax_numpy_and_the_library_at_module_level():
  allowed = {"jax", "numpy", "jaxact", "pallas_kernels", "__future__"}
  outside = {
    f"{path.name}: {name}"
    for path in sorted((ROOT / "jaxact" / "_src" / "test_util").glob("*.py"))
    for name in imported_modules(path.read_text(), top_level_only=True)
    if _top(name) not in allowed and _top(name) not in sys.stdlib_module_names
  }
  assert outside == set()


def test_only_the_library_is_installed():
  """``pip install`` puts jaxact and pallas_kernels into site-packages, not the benchmarks."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  setuptools = project["tool"]["setuptools"]
  assert setuptools["packages"]["find"]["include"] == ["jaxact*", "pallas_kernels*"]
  scripts = project["project"].get("scripts", {})
  assert not [s for s in scripts.values() if _top(s) == "benchmarks"]


def test_jax_programs_of_the_environment_do_not_load_the_cuda_plugin():
  """jax's CUDA compiler, which the GPU compile tests use, lives beside the environment: any other
  jax program there starts on CPU without looking for CUDA (no cuDNN traceback on stderr)."""
  import os
  import subprocess

  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  code = "import jax, jax.numpy as jnp; print(jax.default_backend(), float(jnp.ones(2).sum()))"
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd="/"
  )
  assert out.stdout.split() == ["cpu", "2.0"]
  assert "cuda" not in out.stderr.lower() and "cudnn" not in out.stderr.lower(), out.stderr
