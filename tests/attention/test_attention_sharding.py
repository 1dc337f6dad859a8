"""jaxact.dot_product_attention sharded over 8 virtual CPU devices (attention_sharding_cases.py,
run in a subprocess as tests/core/test_sharding.py explains): data and tensor parallel, multi- and
grouped-query attention with fewer key/value heads than devices, dropout, Explicit and Auto mesh
axes, each equal to one device with no gather of q, k or v; a sequence-sharded query refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import eight_devices

from cases import representatives

SCRIPT = Path(__file__).resolve().parents[1] / "attention_sharding_cases.py"
CASES = [
  "dp_explicit",
  "tp_explicit",
  "mqa_tp_explicit",
  "gqa_tp_explicit",
  "dp_dropout_explicit",
  "tp_auto",
]


# The default suite: grouped-query tensor parallel on Explicit axes (its batch over "data" too: data
# parallel), tensor parallel on Auto axes; the rest under `pytest -m exhaustive`.
DEFAULT = {"gqa_tp_explicit", "tp_auto"}


@pytest.fixture(scope="session")
def results(request, tmp_path_factory) -> dict[str, dict]:
  reads = {"test_a_sequence_sharded_query_is_refused_by_name": "seq_explicit"}
  names = eight_devices.selected_cases(request, __name__, reads)
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


@pytest.mark.parametrize("name", representatives(CASES, DEFAULT))
def test_equal_to_one_device_and_no_gather(results, name):
  r = eight_devices.get(results, name, SCRIPT)
  assert r["err"] < 2e-6
  assert not any(c.startswith(("all-gather", "all-to-all")) for c in r["collectives"])
  # What is reduced: the loss, the bias's gradient over the heads a device does not hold (whole,
  # or a block at a time under Auto axes), and the gradient of key/value heads every device holds
  # (multi/grouped-query under tensor parallelism): nothing larger.
  for c in r["collectives"]:
    dims = [int(d) for d in c.split("[")[1].rstrip("]").split(",") if d]
    assert c.startswith("all-reduce") and math.prod(dims) <= max(r["allowed"]), c


def test_a_sequence_sharded_query_is_refused_by_name(results):
  r = eight_devices.get(results, "seq_explicit", SCRIPT)
  assert "the sequence axis is sharded" in r["error_text"]
