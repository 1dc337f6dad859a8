"""The README and the docs stay true: generated tables current, snippets run, the site builds.

CI runs the README's test command, so the Quick start's second bash block is checked here too.
"""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from jaxact._src import docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "02_flax_training.ipynb"])
def test_notebooks_are_committed_executed(name):
  # GitHub and the docs site (mkdocs-jupyter, execute: false) show the committed outputs.
  nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(cell.execution_count for cell in code), f"run `python notebooks/build.py` ({name})"
  assert any(o.get("output_type") == "display_data" for c in code for o in c.outputs), name


def test_docs_build_strict(tmp_path):
  if importlib.util.find_spec("mkdocs") is None:
    pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
  mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent))
  cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
  out = subprocess.run(
    [*cmd, "build", "--strict", "-d", str(tmp_path / "site")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
  )
  assert out.returncode == 0, out.stdout + out.stderr
  api = (tmp_path / "site" / "api" / "index.html").read_text()
  import jaxact

  # The reference really documents every public name (the activations are built at import time).
  for name in [*jaxact.ACTIVATIONS, "dense_bias_act", "conv_bias_act"]:
    assert f'id="jaxact.{name}"' in api, name
  for name in ["linen.DenseAct", "linen.ConvAct", "nnx.LinearAct", "nnx.ConvAct"]:
    assert f'id="jaxact.{name}"' in api, name
