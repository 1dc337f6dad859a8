"""The README stays true: its residual table is the spec table's, and CI runs its test command."""

import pathlib
import re
import subprocess

from jaxact._src import docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_residual_table_matches_spec_table():
  begin, end = README.index(docs.BEGIN), README.index(docs.END) + len(docs.END)
  assert README[begin:end] == docs.residual_table(), (
    "README's residual table is stale: regenerate it with `python -m jaxact._src.docs`"
  )


def test_every_activation_is_in_the_readme_table():
  import jaxact

  for name in jaxact.ACTIVATIONS:
    assert re.search(rf"^\| `{name}`", README, re.M), name


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
