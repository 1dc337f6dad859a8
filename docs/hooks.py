"""mkdocs hook: serve files that live outside docs/ from where they are, without copies.

The notebooks (`notebooks/*.ipynb`, rendered by mkdocs-jupyter), the benchmark results
(`benchmarks/RESULTS.md`, its figures and the GPU run logs) keep their repository paths in the
site, so their own relative links keep working. Runs before mkdocs-jupyter's `on_files` (higher
priority), which then renders the notebooks added here.
"""

from __future__ import annotations

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOUNTED = [
  "notebooks/*.ipynb",
  "benchmarks/RESULTS.md",
  "benchmarks/figures/*.png",
  "benchmarks/gpu_runs/*.md",
]


def on_config(config):
  for pattern in MOUNTED:
    folder = str(ROOT / pathlib.Path(pattern).parent)
    if folder not in config.watch:
      config.watch.append(folder)
  return config


@event_priority(100)
def on_files(files: Files, config) -> Files:
  for pattern in MOUNTED:
    for path in sorted(ROOT.glob(pattern)):
      rel = path.relative_to(ROOT).as_posix()
      files.append(File(rel, str(ROOT), config.site_dir, config.use_directory_urls))
  return files
