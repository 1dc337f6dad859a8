"""A step's estimated time on a GPU from its compiled program: flops and bytes against the GPU's
rates, the larger of the two times (a roofline), until a GPU measures it.

The counts are XLA's own cost analysis (``HloCostAnalysis``, run here on the optimized HLO text of
a program compiled for the GPU) with what it leaves out put back:

* a ``while`` loop's body counts once there; here it counts its trip count of times (the
  scanned blocks and the attention's chunks): XLA:GPU's ``known_trip_count``, or on XLA:TPU,
  which writes none, the scan's counter and bound read from the loop's condition; a loop whose
  bound is computed at run time (a causal attention's loop up to the diagonal) counts the
  caller's ``unknown_trips`` (its mean, where the caller knows it; else once), and
  :func:`cost` reports how many there were;
* a custom call counts -1 there; here a cuDNN convolution counts its multiply-adds (from its
  shapes), a Mosaic TPU kernel that carries a cost estimate (XLA's TPU ``ragged_dot``, megablox's
  grouped matmuls: ``pl.CostEstimate``) its estimate's flops and bytes, and every other custom
  call its operands and results once (a Pallas kernel's flops are not in its HLO: :func:`cost`
  reports those calls so that the caller can count them another way);
* an asynchronous fusion (``fusion-start`` / ``fusion-done``) is counted as the fusion it wraps.

A fusion's bytes are its operands and results, as XLA counts them: what it reads and writes in the
GPU's memory, nothing of what stays on chip.
"""

from __future__ import annotations

import dataclasses
import math
import re

# NVIDIA H100 SXM5 (80 GB HBM3) data sheet: dense bfloat16 tensor-core peak (989 TFLOP/s without
# sparsity) and HBM3 bandwidth (3.35 TB/s). Peaks: no step reaches them, so the estimate is a
# lower bound on the step's time, the same bound for every way to train a model.
H100_SXM_RATES = {"flops_per_s": 989e12, "bytes_per_s": 3.35e12}

_ITEMSIZE = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes: float
  kernels: tuple[str, ...]  # custom calls whose flops the count leaves out (Pallas kernels)
  # loops whose trip count is computed at run time (a causal attention's inner loop), counted
  # `unknown_trips` times
  unknown_loops: int = 0


def seconds(flops: float, bytes_: float, rates: dict = H100_SXM_RATES) -> float:
  """The roofline estimate: the larger of the time at peak flops and at peak bandwidth."""
  return max(flops / rates["flops_per_s"], bytes_ / rates["bytes_per_s"])


def _split(s: str) -> list[str]:
  """`s` split at its commas outside brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(s[start:i].strip())
      start = i + 1
  return [*parts, s[start:].strip()]


def _type_and_rest(rhs: str) -> tuple[str, str]:
  """An instruction's right-hand side as (its shape, the opcode and what follows)."""
  if not rhs.startswith("("):
    shape, _, rest = rhs.partition(" ")
    return shape, rest
  depth = 0
  for i, ch in enumerate(rhs):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rhs[: i + 1], rhs[i + 2 :]
  raise ValueError(f"unbalanced shape in {rhs[:80]!r}")


def _arrays(shape: str, skip_u8: bool = False) -> list[tuple[str, list[int]]]:
  return [
    (dt, [int(d) for d in dims.split(",") if d])
    for dt, dims in _ARRAY.findall(shape)
    if not (skip_u8 and dt == "u8")
  ]


def _size(arrays) -> int:
  return sum(_ITEMSIZE[dt] * math.prod(dims) for dt, dims in arrays)


def synchronous(text: str) -> str:
  """`text` with each asynchronous fusion written as the fusion it wraps (its done a bitcast)."""
  out = []
  for line in text.split("\n"):
    found = _DEF.match(line)
    if found and " fusion-start(" in line:
      shape, rest = _type_and_rest(found.group(2))
      result = _split(shape[1:-1])[1]
      line = line.replace(f"{shape} fusion-start(", f"{result} fusion(", 1)
      line = line.replace(rest, rest.replace("fusion-start(", "fusion(", 1), 1)
    elif found and " fusion-done(" in line:
      line = line.replace(" fusion-done(", " bitcast(", 1)
    out.append(line)
  return "\n".join(out)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """Each computation's lines by name, and the entry's name."""
  comps, entry, name = {}, "", None
  for line in text.split("\n"):
    header = _HEADER.match(line)
    if header:
      name = header.group(2)
      comps[name] = []
      entry = name if header.group(1) else entry
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def _as_entry(text: str, name: str) -> str:
  """`text` with computation `name` as its entry (its header's module options dropped)."""
  lines = ["HloModule cost"]
  for line in text.split("\n")[1:]:
    line = line.removeprefix("ENTRY ")
    if re.match(r"%?" + re.escape(name) + r" \(", line):
      line = "ENTRY " + line
    lines.append(line)
  return "\n".join(lines)


def _window(line: str, key: str, dims: int, default: str) -> list[int]:
  found = re.search(rf"\b{key}=([\dx_\-]+)", line)
  values = found.group(1).split("x") if found else [default] * dims
  return [int(v.split("_")[0]) for v in values]


def _valid_taps(out: int, size: int, k: int, stride: int, lo: int, dilation: int) -> int:
  """Multiply-adds of one spatial dimension that read the input, not its padding (XLA counts a
  convolution so)."""
  return sum(0 <= o * stride - lo + j * dilation < size for o in range(out) for j in range(k))


def _conv_flops(target: str, line: str, operands: list[str], result: str) -> float:
  """A cuDNN convolution's flops as XLA counts an HLO convolution's: 2 a multiply-add, each
  output feature's multiply-adds over the kernel's input features and the taps that read the
  input (of the forward convolution, which a backward call's window and labels describe)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
  lhs, rhs, out = labels.groups()
  if target.endswith("BackwardFilter"):
    x, kernel, y = operands[0], result, operands[1]
  elif target.endswith("BackwardInput"):
    x, kernel, y = result, operands[1], operands[0]
  else:
    x, kernel, y = operands[0], operands[1], result
  x, kernel, y = (_arrays(a)[0][1] for a in (x, kernel, y))
  spatial = sorted(c for c in out if c.isdigit())
  sizes = re.search(r"size=([\dx]+)", line).group(1).split("x")
  strides = _window(line, "stride", len(spatial), "1")
  dilations = _window(line, "rhs_dilate", len(spatial), "1")
  pads = _window(line, "pad", len(spatial), "0_0")
  taps = math.prod(
    _valid_taps(y[out.index(d)], x[lhs.index(d)], int(sizes[i]), strides[i], pads[i], dilations[i])
    for i, d in enumerate(spatial)
  )
  return 2.0 * y[out.index("b")] * kernel[rhs.index("o")] * kernel[rhs.index("i")] * taps


def _custom_calls(
  lines: list[str], shapes: dict[str, str], estimated_bytes: bool = True
) -> tuple[float, float, list[str]]:
  """(flops, bytes, kernels) of the custom calls in a computation's `lines` (XLA's -1 undone);
  without `estimated_bytes` a kernel's cost estimate gives its flops alone, its bytes its operands
  and results once."""
  flops = bytes_ = 0.0
  kernels = []
  for line in lines:
    found = _DEF.match(line)
    if not found or " custom-call(" not in line:
      continue
    shape, rest = _type_and_rest(found.group(2))
    target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
    args = rest[rest.index("(") + 1 :]
    names = [a.lstrip("%") for a in _split(args[: args.index(")")]) if a]
    operands = [shapes.get(n, "") for n in names]
    cudnn = target.startswith("__cudnn$conv")
    flops += 1
    estimate = re.search(r'"cost_estimate":\{"flops":"(\d+)".*?"bytes_accessed":"(\d+)"', line)
    if estimate:
      flops += float(estimate.group(1))
      if estimated_bytes:
        bytes_ += 1 + float(estimate.group(2))
        continue
    bytes_ += 1 + sum(_size(_arrays(s)) for s in operands) + _size(_arrays(shape, skip_u8=cudnn))
    if cudnn:
      flops += _conv_flops(target, line, operands, _split(shape[1:-1])[0])
    elif not estimate:
      kernels.append(target)
  return flops, bytes_, kernels


def _constant(rhs: str | None, defs: dict[str, str]) -> int | None:
  """The value of an ``s32[]`` constant, `rhs` its definition (or a copy's of it)."""
  copy = re.match(r"s32\[\](?:\{[^}]*\})? copy\(%?([\w.\-]+)\)", rhs or "")
  if copy:
    return _constant(defs.get(copy.group(1)), defs)
  found = re.fullmatch(
    r"s32\[\](?:\{[^}]*\})? constant\((-?\d+)\)", (rhs or "").split(", metadata")[0]
  )
  return int(found.group(1)) if found else None


def trip_count(line: str, comps: dict[str, list[str]], defs: dict[str, str]) -> int | None:
  """A ``while`` instruction's trip count: XLA:GPU's ``known_trip_count``; else (XLA:TPU writes
  none) a counter from a constant compared ``LT`` with a constant in the condition, stepping by 1
  (a ``scan``'s loop); else None (a bound computed at run time)."""
  trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  if trips:
    return int(trips.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", line)
  init = re.search(r" while\(%?([\w.\-]+)\)", line)
  root = next((x for x in comps.get(cond.group(1), []) if "ROOT" in x), "") if cond else ""
  compare = re.search(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=LT", root)
  if compare is None or init is None:
    return None
  counter, limit = defs.get(compare.group(1), ""), _constant(defs.get(compare.group(2)), defs)
  index = re.search(r"get-tuple-element\(.*\), index=(\d+)", counter)
  rest = _type_and_rest(defs[init.group(1)])[1] if init.group(1) in defs else ""
  if limit is None or index is None or not rest.startswith("tuple("):
    return None
  operands = _split(re.sub(r"/\*index=\d+\*/", "", rest[len("tuple(") : rest.index(")")]))
  first = _constant(defs.get(operands[int(index.group(1))].lstrip("%")), defs)
  return max(limit - first, 1) if first is not None else None


def cost(text: str, client, unknown_trips: float = 1, estimated_bytes: bool = True) -> Cost:
  """Flops and bytes of a compiled program's optimized HLO `text`, by XLA's cost analysis on
  `client` (any backend's: the analysis reads the HLO alone), loops counted their trip count of
  times (`unknown_trips` where neither XLA nor the condition says it) and custom calls as the
  module docstring says (without `estimated_bytes`, a kernel's cost estimate gives its flops and
  not its bytes: its operands and results once, as for any custom call)."""
  from jax._src.lib import xla_client

  text = synchronous(text)
  comps, entry = _computations(text)
  shapes = {}
  for lines in comps.values():
    for line in lines:
      if found := _DEF.match(line):
        shapes[found.group(1)] = _type_and_rest(found.group(2))[0]

  def analysis(name: str) -> tuple[float, float]:
    module = xla_client.hlo.hlo_module_from_text(_as_entry(text, name))
    got = xla_client._xla.hlo_module_cost_analysis(client, module)
    return got.get("flops", 0.0), got.get("bytes accessed", 0.0)

  defs = {}  # each instruction's right-hand side by name
  for lines in comps.values():
    for line in lines:
      if found := _DEF.match(line):
        defs[found.group(1)] = found.group(2)
  kernels: list[str] = []
  unknown: list[str] = []

  def total(name: str) -> tuple[float, float]:
    flops, bytes_ = analysis(name)
    f, b, k = _custom_calls(comps[name], shapes, estimated_bytes)
    flops, bytes_ = flops + f, bytes_ + b
    kernels.extend(k)
    for line in comps[name]:
      loop = re.search(r" while\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
      if loop is None:
        continue
      n = trip_count(line, comps, defs)
      if n is None:
        unknown.append(loop.group(2))
        n = unknown_trips
      once, all_ = analysis(loop.group(2)), total(loop.group(2))
      flops += n * all_[0] - once[0]
      bytes_ += n * all_[1] - once[1]
    return flops, bytes_

  flops, bytes_ = total(entry)
  return Cost(flops, bytes_, tuple(sorted(set(kernels))), len(unknown))
