"""Every notebook runs top to bottom, and is the one notebooks/build.py writes.

The notebooks run in a kernel of this interpreter: a kernelspec written to a temporary folder
(ipykernel records `sys.executable` in it) is put first on JUPYTER_PATH, so that neither a user's
own `python3` kernelspec nor a `python` on PATH from another environment is picked up.
"""

import importlib.util
import pathlib
import sys

import nbformat
import pytest
from ipykernel import kernelspec
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "jaxact-tests"


def _build_module():
  spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "build.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


BUILD = _build_module()


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
  prefix = tmp_path_factory.mktemp("kernel")
  kernelspec.install(kernel_name=KERNEL, prefix=str(prefix))
  return prefix / "share" / "jupyter"


def test_notebooks_are_the_built_ones():
  assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(BUILD.NOTEBOOKS)
  for name, cells in BUILD.NOTEBOOKS.items():
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(committed)
    # Committed executed (outputs shown on GitHub and the docs site); the cells are build.py's.
    assert BUILD.without_outputs(committed) == BUILD.notebook(cells), (
      f"notebooks/{name} is not what notebooks/build.py writes: run `python notebooks/build.py`"
    )


# Every notebook (10 to 30 s each) runs under `pytest -m exhaustive`, which CI runs; by default
# each is checked to be what notebooks/build.py writes. Their claims are tested elsewhere: the
# quickstart's by the ops' own tests, the Flax training one's (the same loss curve as
# Flax at less memory) by test_linen/test_nnx's digits training, the GRPO and distillation ones'
# (the plain composition's values and gradients, the compiled temp) by tests/lce/test_policy.py
# and test_distill.py.
@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=[pytest.mark.exhaustive]) for n in sorted(BUILD.NOTEBOOKS)],
)
def test_notebook_runs(name, jupyter_path, monkeypatch):
  monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = NotebookClient(
    nb,
    kernel_name=KERNEL,
    timeout=300,
    resources={"metadata": {"path": str(NOTEBOOKS)}},
  )
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
  ran = [cell for cell in nb.cells if cell.cell_type == "code" and cell.execution_count]
  assert len(ran) == sum(cell.cell_type == "code" for cell in nb.cells)


def test_kernel_is_this_interpreter(jupyter_path, monkeypatch):
  monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
  nb = nbformat.v4.new_notebook(
    cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")]
  )
  NotebookClient(nb, kernel_name=KERNEL, timeout=120).execute()
  assert nb.cells[0].outputs[0].text.strip() == sys.executable


def test_colab_badges_and_install_follow_pyproject():
  for name in BUILD.NOTEBOOKS:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert f"colab.research.google.com/github/{BUILD.GITHUB_PATH}/blob/main/notebooks/{name}" in (
      text
    )
    assert f"git+{BUILD.REPOSITORY}" in text
    assert 'if "google.colab" in sys.modules:' in text
