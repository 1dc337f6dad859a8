"""The README and the docs stay true: generated tables current, snippets run, the site builds.

CI runs the README's test command, so the Quick start's second bash block is checked here too.
"""

import fcntl
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from jaxact._src import docs

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
RESIDUAL_PAGE = (DOCS / "residual-policy.md").read_text()
SNIPPET_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_residual_table_matches_spec_table():
  begin, end = RESIDUAL_PAGE.index(docs.BEGIN), RESIDUAL_PAGE.index(docs.END) + len(docs.END)
  assert RESIDUAL_PAGE[begin:end] == docs.residual_table(), (
    "docs/residual-policy.md's table is stale: regenerate it with `python -m jaxact._src.docs`"
  )


def test_dispatch_table_matches_the_dispatch_rules():
  page = (DOCS / "dispatch.md").read_text()
  begin = page.index(docs.DISPATCH_BEGIN)
  end = page.index(docs.DISPATCH_END) + len(docs.DISPATCH_END)
  assert page[begin:end] == docs.dispatch_table(), (
    "docs/dispatch.md's table is stale: regenerate it with `python -m jaxact._src.docs`"
  )


def test_codes_table_matches_the_stored_codes():
  begin = RESIDUAL_PAGE.index(docs.CODES_BEGIN)
  end = RESIDUAL_PAGE.index(docs.CODES_END) + len(docs.CODES_END)
  assert RESIDUAL_PAGE[begin:end] == docs.codes_table(), (
    "docs/residual-policy.md: the codes table is stale; run `python -m jaxact._src.docs`"
  )


def test_every_activation_is_in_the_residual_table():
  import jaxact

  for name in jaxact.ACTIVATIONS:
    assert re.search(rf"^\| `{name}`", RESIDUAL_PAGE, re.M), name


def _quick_start_blocks() -> list[str]:
  section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.*?)\n```", section, re.S)


def test_quick_start_has_main_job_then_tests():
  blocks = _quick_start_blocks()
  assert len(blocks) == 2, blocks
  assert "python -m benchmarks" in blocks[0]
  assert "pytest" in blocks[1]


def test_ci_runs_the_readme_test_command():
  # .ci/run's extraction must find exactly the second Quick start block.
  script = (ROOT / ".ci" / "run").read_text()
  awk = re.search(r"cmd=\$\(awk '(.*?)' README.md\)", script, re.S).group(1)
  out = subprocess.run(
    ["awk", awk, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == _quick_start_blocks()[1].strip()


def test_readme_is_short():
  # What a visitor needs first; the rest is in docs/.
  assert len(README.encode()) <= 10_500


@pytest.mark.parametrize("path", SNIPPET_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_snippets_run(path):
  # Every ```python block of a file, in order, in one fresh namespace per file.
  blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
  namespace = {"__name__": f"snippets_{path.stem}"}
  for i, block in enumerate(blocks):
    exec(compile(block, f"{path.relative_to(ROOT)} (python block {i + 1})", "exec"), namespace)


@pytest.mark.parametrize(
  "name",
  [
    "01_quickstart.ipynb",
    "02_flax_training.ipynb",
    "03_grpo.ipynb",
    "04_distillation.ipynb",
    "05_trainer_options.ipynb",
  ],
)
def test_notebooks_are_committed_executed(name):
  # GitHub and the docs site (mkdocs-jupyter, execute: false) show the committed outputs.
  nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(cell.execution_count for cell in code), f"run `python notebooks/build.py` ({name})"
  assert any(o.get("output_type") == "display_data" for c in code for o in c.outputs), name


def _build_site(site: pathlib.Path) -> dict:
  mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent))
  cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
  out = subprocess.run(
    [*cmd, "build", "--strict", "-d", str(site)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
  )
  return {"returncode": out.returncode, "output": out.stdout + out.stderr}


@pytest.fixture(scope="session")
def site(tmp_path_factory):
  """The docs site, built once per test session: under pytest-xdist the workers share one build
  (the first to take the lock builds it, the others read its result)."""
  if importlib.util.find_spec("mkdocs") is None:
    pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
  if "PYTEST_XDIST_WORKER" not in os.environ:
    path = tmp_path_factory.mktemp("docs") / "site"
    return path, _build_site(path)
  shared = tmp_path_factory.getbasetemp().parent  # this session's, common to its workers
  path, result = shared / "docs-site", shared / "docs-site.json"
  with open(shared / "docs-site.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not result.exists():
      result.write_text(json.dumps(_build_site(path)))
  return path, json.loads(result.read_text())


# The site's build (mkdocs, 10 s) runs under -m exhaustive, which CI runs: the snippets above and
# the link and index checks are the default run's share of the docs.
@pytest.mark.exhaustive
def test_docs_build_strict(site):
  path, build = site
  assert build["returncode"] == 0, build["output"]
  api = (path / "api" / "index.html").read_text()
  import jaxact

  # The reference really documents every public name (the activations are built at import time).
  for name in [*jaxact.ACTIVATIONS, "dense_bias_act", "conv_bias_act"]:
    assert f'id="jaxact.{name}"' in api, name
  for name in ["linen.DenseAct", "linen.ConvAct", "nnx.LinearAct", "nnx.ConvAct"]:
    assert f'id="jaxact.{name}"' in api, name


OFF_SITE = r"""(?:https?:)?//"""
# What a page would fetch from elsewhere to show itself: scripts, stylesheets (and the connections
# and preloads that serve them), CSS imports and fonts, and a script or stylesheet URL anywhere
# (a loader that adds its script at run time).
FETCHES = [
  re.compile(rf"""<script\b[^>]*\bsrc=["']?{OFF_SITE}[^"'\s>]*""", re.I),
  re.compile(
    rf"""<link\b(?=[^>]*\brel=["']?[^"'>]*(?:stylesheet|preconnect|preload|import))"""
    rf"""[^>]*\bhref=["']?{OFF_SITE}[^"'\s>]*""",
    re.I,
  ),
  re.compile(rf"""@import\s+(?:url\()?["']?{OFF_SITE}[^"')\s;]*""", re.I),
  re.compile(rf"""url\(\s*["']?{OFF_SITE}[^"')\s]*""", re.I),
  re.compile(rf"""{OFF_SITE}[^"'\s<>&)]+\.(?:js|mjs|css|woff2?|ttf|otf)\b""", re.I),
]


def offsite_fetches(text: str) -> list[str]:
  return [m.group(0) for pattern in FETCHES for m in pattern.finditer(text)]


def test_offsite_fetches_are_found():
  # The patterns catch what the site loaded before: MathJax, Google Fonts, mkdocs-jupyter's loader.
  assert offsite_fetches('<script src="https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js">')
  assert offsite_fetches('<link rel="stylesheet" href="https://fonts.googleapis.com/css?f=R">')
  assert offsite_fetches('<link href="//cdn.example.org/a.css" rel="stylesheet">')
  assert offsite_fetches("@import url(https://fonts.googleapis.com/css2?family=Roboto);")
  assert offsite_fetches("src: url(//fonts.gstatic.com/s/roboto.woff2)")
  loader = '<script data-x="{&quot;url&quot;: &quot;https://cdn.jsdelivr.net/npm/m/t.js&quot;}">'
  assert offsite_fetches(loader)
  local = '<script src="../assets/javascripts/bundle.js"></script><a href="https://github.com/x">'
  assert not offsite_fetches(local + '<link rel="stylesheet" href="assets/main.css">')


@pytest.mark.exhaustive
def test_docs_site_loads_nothing_from_elsewhere(site):
  """Read offline, every page shows all it has: no script, stylesheet or font from another
  host, and the math is MathML, drawn without a script."""
  path, build = site
  if build["returncode"] != 0:
    pytest.skip("the site did not build (test_docs_build_strict says why)")
  pages = sorted(path.rglob("*.html"))
  assert len(pages) > 20 and (path / "api" / "index.html") in pages
  found = {
    f"{p.relative_to(path)}: {fetch}"
    for p in [*pages, *path.rglob("*.css")]
    for fetch in offsite_fetches(p.read_text(errors="replace"))
  }
  assert not found, sorted(found)
  for name in ["api", "residual-policy", "lce", "gated"]:
    text = (path / name / "index.html").read_text()
    assert "<math" in text and not re.search(r'class="arithmatex">\s*\\[(\[]', text), name


def _nav_pages(nav) -> list[str]:
  if isinstance(nav, str):
    return [nav]
  if isinstance(nav, dict):
    return [p for item in nav.values() for p in _nav_pages(item)]
  return [p for item in nav for p in _nav_pages(item)]


def test_reading_list_has_every_nav_page():
  yaml = pytest.importorskip("yaml")
  nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
  index = (DOCS / "index.md").read_text()
  reading = index.split("## What to read", 1)[1].split("\n## ", 1)[0]
  linked = set(re.findall(r"\]\(([^)#\s]+)", reading))
  missing = [page for page in nav if page != "index.md" and page not in linked]
  assert not missing, f"docs/index.md's reading list ('What to read') lacks {missing}"


def test_every_results_page_is_linked_and_short():
  index = (ROOT / "benchmarks" / "RESULTS.md").read_text()
  overview = (DOCS / "results.md").read_text()
  pages = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
  assert len(pages) >= 7
  for page in pages:
    assert f"](results/{page.name})" in index, f"benchmarks/RESULTS.md does not link {page.name}"
    assert f"](benchmarks/results/{page.name})" in overview, f"docs/results.md lacks {page.name}"
    lines = page.read_text().count("\n")
    assert lines <= 300, f"benchmarks/results/{page.name} has {lines} lines: split it by topic"
  assert index.count("\n") <= 60, "benchmarks/RESULTS.md is the index: the figures go in results/"


# ------------------------------------------------------------- cross-references in docstrings

_ROLE = re.compile(r":(mod|func|class|data|attr|meth|obj|exc):`~?([^`<>]+)`")


def _resolves(target: str, module: str) -> bool:
  """Whether `target` (absolute, relative with leading dots, or a name in `module`) names an
  importable module or an attribute chain (a dataclass field or an annotation counts)."""
  if target.startswith("."):
    up = len(target) - len(target.lstrip("."))
    target = module.rsplit(".", up)[0] + "." + target.lstrip(".")
  for name in (target, f"{module}.{target}"):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
      try:
        obj = importlib.import_module(".".join(parts[:i]))
      except ImportError:
        continue
      for attr in parts[i:-1]:
        obj = getattr(obj, attr, None)
      last = parts[-1] if i < len(parts) else None
      if obj is not None and (
        last is None
        or hasattr(obj, last)
        or last in getattr(obj, "__annotations__", {})
        or last in getattr(obj, "__dataclass_fields__", {})
      ):
        return True
      break
  return False


def test_every_docstring_reference_resolves():
  """Every ``:mod:``, ``:func:``, ``:class:`` (...) role in the library's and the kernels' sources
  names something that exists: modules that moved leave no stale names behind."""
  bad = []
  for folder in ("jaxact", "pallas_kernels"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
      for role in _ROLE.finditer(path.read_text()):
        if not _resolves(role.group(2).strip(), module):
          bad.append(f"{path.relative_to(ROOT)}: :{role.group(1)}:`{role.group(2)}`")
  assert bad == []
