"""griffe extension: the reST bits of jaxact's docstrings (jax's style) as Markdown.

jaxact's docstrings are written as jax's and optax's are: formulas under ``.. math::`` and
cross-references as ``:func:`name```. mkdocstrings renders Markdown, so before it parses a
docstring this turns each ``.. math::`` block into a ``$$ ... $$`` block (rendered by
``pymdownx.arithmatex``) and each role into inline code.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")


def _math_blocks(text: str) -> str:
  lines, out, i = text.split("\n"), [], 0
  while i < len(lines):
    line = lines[i]
    found = re.match(r"^(\s*)\.\. math::\s*$", line)
    if not found:
      out.append(line)
      i += 1
      continue
    indent, body, i = found.group(1), [], i + 1
    while i < len(lines) and (
      not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
    ):
      body.append(lines[i].strip())
      i += 1
    while body and not body[-1]:
      body.pop()
    out += [f"{indent}$$", *(f"{indent}{b}" for b in body if b), f"{indent}$$", ""]
  return "\n".join(out)


def markdown(text: str) -> str:
  """`text` with ``.. math::`` blocks as ``$$`` blocks and reST roles as inline code."""
  return _ROLE.sub(r"`\1`", _math_blocks(text))


class RstToMarkdown(griffe.Extension):
  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is not None:
      obj.docstring.value = markdown(obj.docstring.value)
