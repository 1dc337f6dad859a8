"""Install libtpu (XLA's TPU compiler) into ``<venv>/tpu-compiler``, outside the venv's
site-packages.

tests/core/test_tpu_compile.py and ``python -m benchmarks tpu`` compile jaxact's ops for TPU v5e,
v5p and v6e chips and slices on a machine without a TPU (``support.tpu``). Kept in its own folder,
libtpu loads only where ``support.tpu.use_tpu_compiler`` puts it on ``sys.path``. The version is
the one jax's ``tpu`` extra pins (``jax[tpu]``), read from the installed jax's metadata. Linux only
(libtpu's wheels).

    .venv/bin/python tests/install_tpu_compiler.py
"""

import importlib.metadata
import pathlib
import re
import subprocess
import sys


def pinned() -> str:
  """The libtpu requirement of jax's ``tpu`` extra (``libtpu==0.0.50.*`` for jax 0.12.0.1)."""
  for req in importlib.metadata.requires("jax") or []:
    found = re.match(r"\s*(libtpu\b[^;]*);.*extra\s*==\s*['\"]tpu['\"]", req)
    if found:
      return found.group(1).replace(" ", "")
  raise RuntimeError(f"jax {importlib.metadata.version('jax')} pins no libtpu in its tpu extra")


def main() -> int:
  if sys.platform != "linux":
    print("libtpu has Linux wheels only: tests/core/test_tpu_compile.py will skip")
    return 0
  target = pathlib.Path(sys.prefix) / "tpu-compiler"
  pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--upgrade"]
  subprocess.run([*pip, "--target", str(target), pinned()], check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
