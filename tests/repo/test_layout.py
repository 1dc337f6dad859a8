"""The repository's boundaries: benchmarks consume the library; the support package serves tests
and benchmarks and is not installed; only the library is installed; the library is laid out as its
op families, one folder each, with no import circle and no module outgrown one reading."""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
import tomllib

import pytest

from conftest import SAMPLE_COVERAGE, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
  support, never in a test module."""
  tests = {p.stem for p in _sources("tests") if p.stem.startswith("test_")}
  offenders = [
    f"{p.relative_to(ROOT)}: {name}"
    for p in _sources("tests")
    for name in imported_modules(p.read_text())
    if name.split(".")[-1] in tests
  ]
  assert offenders == []


@pytest.mark.parametrize("folder", ["jaxact", "pallas_kernels"])
def test_the_library_never_imports_the_support_package(folder):
  offenders = [
    f"{p.relative_to(ROOT)}: {name}"
    for p in _sources(folder)
    for name in imported_modules(p.read_text())
    if _top(name) == "support"
  ]
  assert offenders == [], "support/ serves tests and benchmarks; the library never imports it"


def test_support_imports_only_jax_numpy_and_the_library_at_module_level():
  allowed = {"jax", "numpy", "jaxact", "pallas_kernels", "support", "__future__"}
  outside = {
    f"{path.name}: {name}"
    for path in sorted((ROOT / "support").glob("*.py"))
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


# ------------------------------------------------------------------------------ jaxact's layout

JAXACT = ROOT / "jaxact"
SRC = JAXACT / "_src"
MAX_LINES = 450
# Tables, not code to read: the activation spec table and the generated few-bit code table.
TABLES = {"jaxact/_src/core/spec.py", "jaxact/_src/codes/table.py"}
MAX_TOP_ENTRIES = 16


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = path.relative_to(root).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _import_graph(package: pathlib.Path = JAXACT) -> dict[str, set[str]]:
  """Every module of `package` to the modules of `package` it imports, wherever the import stands
  (inside a function, under ``if TYPE_CHECKING:``): ``from a.b import c`` is an arrow to ``a.b.c``
  when that is a module, else to ``a.b``; the packages a name passes through are not arrows."""
  paths = {_module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
  graph = {}
  for name, path in paths.items():
    package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
    arrows = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package, `level - 1` packages up
          up = package_name.split(".")[: len(package_name.split(".")) - (node.level - 1)]
          base = ".".join([*up, base] if base else up)
        targets = [f"{base}.{alias.name}" for alias in node.names]
        targets = [t if t in paths else base for t in targets]
      else:
        continue
      arrows |= {t for t in targets if t in paths and t != name}
    graph[name] = arrows
  return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_circle_finder_sees_every_form_of_import(tmp_path):
  assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _circles({"a": {"b"}, "b": set()}) == []
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  files = {
    "__init__.py": "",
    "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg.sub import b\n",
    "sub/__init__.py": "",
    "sub/b.py": "def f():\n  from .. import c\n",
    "c.py": "import pkg.a\nfrom pkg.sub.b import f\n",
  }
  for name, text in files.items():
    (package / name).write_text(text)
  graph = _import_graph(package)
  assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
  assert _circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_circle_in_jaxact():
  """Shared pieces sit below the families and nothing below imports anything above: no two jaxact
  modules reach each other through imports, counting imports inside functions and under
  ``TYPE_CHECKING``."""
  graph = _import_graph()
  assert "jaxact._src.core.dispatch" in graph and graph["jaxact"]  # the walk sees the tree
  circles = _circles(graph)
  described = [
    " -> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
    for c in circles
  ]
  assert described == []


def test_core_imports_no_family():
  """``core/`` is the ground floor: its modules import nothing of jaxact outside it."""
  graph = _import_graph()
  core = {m for m in graph if m.startswith("jaxact._src.core")}
  assert core
  above = {f"{m} -> {t}" for m in core for t in graph[m] if not t.startswith("jaxact._src.core")}
  assert above == set()


# The floors of jaxact/_src, lowest first: a module imports its own folder and the floors below.
FLOORS = (
  ("core",),
  ("codes",),
  ("activations",),
  ("layers",),  # the Flax plumbing the families' layers share
  # the op families: none imports another
  (FAMILIES := ("fused", "gated", "norms", "norm_act", "attention", "lce", "moe")),
  ("swap",),  # Flax's own modules and jax.nn's activations routed to the families' ops
)


def test_families_import_only_the_floors_below_them():
  graph = _import_graph()
  floor = {name: i for i, names in enumerate(FLOORS) for name in names}
  assert set(floor) <= {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
  wrong = set()
  for module, targets in graph.items():
    parts = module.split(".")
    if parts[:2] != ["jaxact", "_src"] or len(parts) < 3 or parts[2] not in floor:
      continue
    for target in targets:
      t = target.split(".")
      if t[:2] != ["jaxact", "_src"] or len(t) < 3 or t[2] == parts[2]:
        continue
      if t[2] not in floor or floor[t[2]] >= floor[parts[2]]:
        wrong.add(f"{module} -> {target}")
  assert wrong == set()


# A family's files, by job (docs/architecture.md); a file that would outgrow one reading is split
# as `<file>_<part>.py`.
FAMILY_FILES = (
  "__init__",
  "api",
  "plan",
  "rules",
  "vjp",
  "xla",
  "kernels",
  "sharding",
  "reference",
  "linen",
  "nnx",
)


def test_every_family_names_its_files_from_one_vocabulary():
  families = FAMILIES
  named = {
    f"{family}/{p.name}"
    for family in families
    for p in (SRC / family).glob("*.py")
    if p.stem.split("_")[0] not in FAMILY_FILES and p.stem != "__init__"
  }
  assert named == set(), f"name these from {FAMILY_FILES} (or <file>_<part>)"
  # every op family has its plain formula and its Flax layers
  for family in families:
    assert {"api", "reference", "linen", "nnx"} <= {p.stem for p in (SRC / family).glob("*.py")}


def test_a_familys_linen_and_nnx_layers_share_through_its_api_not_each_other():
  graph = _import_graph()
  sideways = {
    f"{m} -> {t}"
    for m, targets in graph.items()
    for t in targets
    if m.startswith("jaxact._src.")
    and t.startswith("jaxact._src.")
    and {m.split(".")[-1], t.split(".")[-1]} <= {"linen", "nnx"}
    and m.split(".")[2] == t.split(".")[2]
  }
  assert sideways == set()


def test_no_module_has_outgrown_one_reading():
  paths = sorted(JAXACT.rglob("*.py"))
  lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}
  assert set(lengths) >= TABLES, "a named table moved: update TABLES"
  long = {p: n for p, n in lengths.items() if n > MAX_LINES and p not in TABLES}
  assert long == {}, f"split these modules (at most {MAX_LINES} lines but the tables {TABLES})"


def test_jaxact_src_shows_its_families_at_its_top():
  entries = sorted(p.name for p in SRC.iterdir() if p.name != "__pycache__")
  assert len(entries) <= MAX_TOP_ENTRIES, entries
  families = [p.name for p in SRC.iterdir() if (p / "__init__.py").exists()]
  for family in families:  # each folder says what it holds
    assert ast.get_docstring(ast.parse((SRC / family / "__init__.py").read_text())), family


PALLAS = ROOT / "pallas_kernels"
_BACKENDS = ("triton", "mosaic", "splash")  # splash: jax's Mosaic TPU attention, adapted


def test_pallas_kernels_are_named_op_first_then_backend_and_stay_short():
  """Each kernel module is ``<op>_<backend>[_<part>].py``; the shared pieces are the two backend
  imports (``_triton``, ``_mosaic``) and the backend-neutral epilogue; none outgrows a reading."""
  shared = {"__init__", "_triton", "_mosaic", "epilogue"}
  misnamed = [
    p.name
    for p in PALLAS.glob("*.py")
    if p.stem not in shared and not any(f"_{b}" in p.stem for b in _BACKENDS)
  ]
  assert misnamed == []
  long = {
    p.name: n for p in PALLAS.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
  }
  assert long == {}


def test_no_kernel_module_imports_another_ones_private_names():
  private = {
    f"{node.module}.{alias.name}"
    for p in PALLAS.glob("*.py")
    for node in ast.walk(ast.parse(p.read_text()))
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pallas_kernels.")
    for alias in node.names
    if alias.name.startswith("_")
  }
  assert private == set()


# ------------------------------------------------------------------------------ the default sample


def test_the_default_sample_names_every_activation_dtype_and_option(request):
  """Every activation, dtype, option and function a sampled-out case names (``sample(n)`` in
  tests/conftest.py) is named by some case of the default run: sampling thins the surveys, it never
  drops a corner. Checked when the whole suite is collected."""
  coverage = request.config.stash[SAMPLE_COVERAGE]
  every = {str(p) for p in (ROOT / "tests").rglob("test_*.py")}
  if not every <= coverage["files"]:
    pytest.skip("only part of the suite was collected: run the whole default suite")
  uncovered = coverage["uncovered"]
  listed = "\n".join(f"  {name!r}: only in {case}" for name, case in sorted(uncovered.items()))
  assert not uncovered, f"named by no default case (raise that test's sample(n)):\n{listed}"


def test_the_coverage_check_reads_what_a_case_names():
  import jax.numpy as jnp
  import numpy as np

  import jaxact

  class Item:
    def __init__(self, **params):
      self.callspec = type("CallSpec", (), {"params": params})

  item = Item(
    name="gelu",
    dtype=jnp.bfloat16,
    dt=np.dtype("float16"),
    spec=jaxact.get_spec("elu"),
    fn=jaxact.silu,
    n=3,
    shape=(2, 3),
    flag=True,
  )
  assert tokens(item) == {"gelu", "bfloat16", "float16", "elu", "silu"}
