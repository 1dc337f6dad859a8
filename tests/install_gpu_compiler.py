"""Install jax's CUDA compiler into ``<venv>/gpu-compiler``, outside the venv's site-packages.

tests/core/test_gpu_compile.py and ``python -m benchmarks aot`` compile jaxact's kernels for an
H100 or an A100 on a machine without a GPU through jax's CUDA plugin (XLA's GPU compiler; no CUDA
libraries). Installed in site-packages, the plugin would load in every jax program of the venv and,
on a machine without CUDA, print a "Unable to load cuDNN" traceback at each start; kept in its own
folder it loads only where ``support.use_gpu_compiler`` puts it on ``sys.path``.
The plugin must match jaxlib's version exactly. Linux only (the plugin's wheels).

    .venv/bin/python tests/install_gpu_compiler.py
"""

import pathlib
import subprocess
import sys

import jaxlib


def main() -> int:
  if sys.platform != "linux":
    print("jax's CUDA plugin has Linux wheels only: tests/core/test_gpu_compile.py will skip")
    return 0
  target = pathlib.Path(sys.prefix) / "gpu-compiler"
  version = jaxlib.__version__
  packages = [f"jax-cuda12-plugin=={version}", f"jax-cuda12-pjrt=={version}"]
  pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--upgrade"]
  subprocess.run([*pip, "--target", str(target), *packages], check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
