"""The main job's frontier logic (benchmarks/harness/frontier.py) on made-up points: the Pareto
front, the two summary numbers, and what the table says when Flax holds part of the front.

benchmarks/harness/frontier.py is pure Python; it is loaded from its file (tests import nothing
from benchmarks/, tests/repo/test_layout.py), as tests/repo/test_notebooks.py loads
notebooks/build.py."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
  name = "benchmarks_frontier"
  spec = importlib.util.spec_from_file_location(
    name, ROOT / "benchmarks" / "harness" / "frontier.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


fr = _load()


def points(**by_key):
  return [fr.point(key, memory, time) for key, (memory, time) in by_key.items()]


# An MLP-like model: remat saves memory at a time cost, jaxact's codes beat it on both.
GELU = points(
  flax=(23, 1.0),
  remat=(9, 1.08),
  dots=(16, 1.02),
  jaxact=(15, 0.95),
  jaxact_remat=(9, 1.09),
  jaxact_4=(9, 0.93),
  jaxact_2=(8, 0.96),
)
# A model where jaxact is slower than Flax everywhere: Flax keeps the fast end of the front.
SLOW = points(
  flax=(1266, 1.0),
  remat=(204, 1.12),
  names=(570, 1.12),
  jaxact=(620, 1.02),
  jaxact_remat=(204, 1.10),
  jaxact_names=(556, 1.01),
)


def _keys(ps):
  return [p.key for p in ps]


def test_point_library_and_label_come_from_the_key():
  assert fr.point("jaxact_4", 9, 0.9) == fr.Point("jaxact_4", "jaxact 4 bits", "jaxact", 9, 0.9)
  assert fr.point("remat", 9, 1.1).library == fr.FLAX
  # The decoder's jaxact with jax.nn's attention is jaxact's point, not Flax's.
  assert fr.point("jaxact_nn_attn_remat", 73, 1.0).library == fr.JAXACT
  with pytest.raises(ValueError, match="`key` 'jaxact_3' is not known"):
    fr.point("jaxact_3", 9, 0.9)


def test_beats_needs_one_strict_improvement():
  a, same, smaller, slower = (fr.point("jaxact", m, t) for m, t in ((9, 1), (9, 1), (8, 1), (8, 2)))
  assert not fr.beats(a, same) and not fr.beats(same, a)
  assert fr.beats(smaller, a) and not fr.beats(a, smaller)
  assert not fr.beats(slower, a) and not fr.beats(a, slower)


def test_front_keeps_the_unbeaten_points_by_memory():
  assert _keys(fr.front(GELU)) == ["jaxact_2", "jaxact_4"]
  assert _keys(fr.front(SLOW)) == ["jaxact_remat", "jaxact_names", "flax"]
  # Two equal points are both on the front: neither beats the other.
  tied = points(flax=(10, 1.0), jaxact=(10, 1.0), remat=(12, 1.1))
  assert _keys(fr.front(tied)) == ["flax", "jaxact"]


def test_verdict_gives_the_two_numbers():
  v = fr.verdict(GELU)
  assert v.flax.key == "flax" and v.remat.key == "remat"
  # At remat's 9 buffers or less: 4 bits (9, 0.93) is faster than 2 bits (8, 0.96) and remat.
  assert v.fastest.key == "jaxact_4"
  # At Flax's time or less: 2 bits has the least memory.
  assert v.smallest.key == "jaxact_2"
  assert v.flax_front == ()


def test_verdict_says_none_and_names_the_unbeaten_flax_points():
  v = fr.verdict(SLOW)
  assert v.fastest.key == "jaxact_remat"
  assert v.smallest is None  # every jaxact point is slower than Flax
  assert _keys(v.flax_front) == ["flax"]
  fastest, smallest, on_front = fr.cells(v, "MiB")
  assert fastest == "**1.10x**: jaxact + remat, 204"
  assert smallest == "none"
  assert on_front == "Flax (1266, 1.00x)"
  text = fr.sentence(v, "MiB")
  assert "jaxact's least temp: none." in text
  assert "beaten by no jaxact point: Flax (1266 MiB, 1.00x)." in text


def test_a_flax_point_on_the_front_is_level_with_a_jaxact_point_whose_rounds_overlap():
  """A Flax point the front keeps by less than its rounds resolve names the smallest jaxact
  point as small or smaller whose rounds' ratios overlap; rounds apart, or a larger jaxact
  point, is no tie."""
  remat = fr.point("remat", 204, 0.96, (0.95, 0.97))
  near = fr.point("jaxact_remat", 183, 0.97, (0.95, 0.99))
  far = fr.point("jaxact_input", 200, 1.05, (1.03, 1.08))
  big = fr.point("jaxact", 599, 0.94, (0.93, 0.95))
  flax = fr.point("flax", 1266, 1.0, (1.0, 1.0))
  assert fr.level_with(remat, [remat, near, far, big]) == near
  assert fr.level_with(remat, [remat, far, big]) is None
  v = fr.verdict([flax, remat, near, far, big])
  assert [p.key for p in v.flax_front] == ["remat"]
  assert fr.cells(v, "MiB")[2] == "Flax + remat (204, 0.96x) (level with jaxact + remat)"
  assert "Flax + remat (204 MiB, 0.96x) (level with jaxact + remat)." in fr.sentence(v, "MiB")
  # Without rounds (estimates), level means the same time.
  a, b = fr.point("remat", 10, 1.2), fr.point("jaxact_remat", 10, 1.2)
  assert fr.level_with(a, [a, b]) == b and fr.level_with(a, [fr.point("jaxact", 9, 1.21)]) is None


def test_remat_reference_is_flax_least_memory_point():
  # The reference for "at Flax + remat's memory" is Flax's smallest remat point, whichever.
  ps = points(flax=(20, 1.0), remat=(12, 1.2), dots=(10, 1.1), jaxact=(11, 0.9))
  v = fr.verdict(ps)
  assert v.remat.key == "dots"
  assert v.fastest is None  # jaxact's only point has more memory than 10
  assert fr.cells(v, "buffers")[0] == "none"
  assert "jaxact's best step time: none." in fr.sentence(v, "buffers")


def test_verdict_needs_flax_and_a_remat_point():
  with pytest.raises(ValueError, match="one point with key 'flax'"):
    fr.verdict(points(remat=(9, 1.1), jaxact=(9, 0.9)))
  with pytest.raises(ValueError, match="no Flax point under remat"):
    fr.verdict(points(flax=(16, 1.0), jaxact=(9, 0.9)))


def test_table_marks_the_front_and_shows_the_rounds_spread():
  rows = fr.table([*SLOW, fr.point("dots", 570, 1.05, (0.98, 1.12))], "MiB")
  assert rows[0] == "| point | temp (MiB) | step time / Flax | rounds' least-most | on the front |"
  marked = {row.split(" | ")[0].lstrip("| ") for row in rows[2:] if row.endswith("| yes |")}
  assert marked == {"Flax", "jaxact + remat", "jaxact + remat(names)"}
  assert "| Flax + remat(dots) | 570 | 1.05 | 0.98-1.12 |  |" in rows
  assert "| Flax | 1266 | 1.00 | — | yes |" in rows


@pytest.mark.exhaustive  # CI's exhaustive stage; the rows and GPU-run tests import theirs
def test_every_benchmark_module_imports():
  """The main job and every benchmark import against the library as it is laid out now (a moved
  private module broke `python -m benchmarks` once while every test passed)."""
  import importlib
  import pathlib

  folder = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
  for path in sorted(folder.rglob("*.py")):
    name = ".".join(path.relative_to(folder.parent).with_suffix("").parts)
    if not name.endswith("__main__"):
      importlib.import_module(name.removesuffix(".__init__"))
  assert "benchmarks.fused_models" in __import__("sys").modules
