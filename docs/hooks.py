"""mkdocs hooks: files served from outside docs/, and math rendered at build time.

The notebooks (`notebooks/*.ipynb`, rendered by mkdocs-jupyter), the benchmark results (the index
`benchmarks/RESULTS.md`, the pages of `benchmarks/results/` and their history, their figures and
the GPU run logs) keep their repository paths in the site, so their own relative links keep
working. Runs before mkdocs-jupyter's `on_files` (higher priority), which then renders the
notebooks added here.

Math (`$...$`, `$$...$$`, and the docstrings' `.. math::`, which `pymdownx.arithmatex` wraps as
`\\(...\\)` / `\\[...\\]`) becomes MathML here, with latex2mathml: browsers draw it without a
script, a font or a network connection, so the site reads the same offline.
"""

from __future__ import annotations

import html
import pathlib
import re

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOUNTED = [
  "notebooks/*.ipynb",
  "benchmarks/RESULTS.md",
  "benchmarks/results/*.md",
  "benchmarks/results/history/*.md",
  "benchmarks/figures/*.png",
  "benchmarks/gpu_runs/*.md",
]

# pymdownx.arithmatex's generic output: an inline span or a display div around escaped TeX.
_MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
_TEX = re.compile(r"\\\((.*)\\\)|\\\[(.*)\\\]", re.S)
# mkdocs-jupyter puts a loader on every page that fetches MathJax from a CDN for notebook math;
# the math here is MathML already (and the notebooks have none).
_NOTEBOOK_MATHJAX = re.compile(r"<script data-mkdocs-jupyter-mathjax=.*?</script>\n?", re.S)


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


def mathml(page_html: str, where: str = "") -> str:
  """`page_html` with each arithmatex span/div's TeX replaced by MathML (inline / display)."""

  def render(found: re.Match) -> str:
    tag, body = found.groups()
    tex = html.unescape(body).strip()
    inner = _TEX.fullmatch(tex)
    try:
      if inner is None:
        raise ValueError("not wrapped in \\(...\\) or \\[...\\]")
      source = inner.group(1) if inner.group(1) is not None else inner.group(2)
      math = convert(source.strip(), display="block" if tag == "div" else "inline")
    except Exception as e:
      raise PluginError(f"{where}: cannot render the math {tex!r} as MathML: {e}") from e
    return f'<{tag} class="arithmatex">{math}</{tag}>'

  return _MATH.sub(render, page_html)


def on_page_content(page_html: str, page, config, files) -> str:
  return mathml(page_html, page.file.src_uri)


@event_priority(-100)  # after mkdocs-jupyter's on_post_page, which adds its loader
def on_post_page(output: str, page, config) -> str:
  return _NOTEBOOK_MATHJAX.sub("", output)
