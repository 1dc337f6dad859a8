"""The parameters of transformers' MoE blocks (Mixtral, Qwen2/3-MoE, DeepSeek-V3) as
:func:`jaxact.moe_mlp` takes them: :func:`moe_params_from_transformers`.

Pure array code (no torch): PyTorch's ``Linear.weight`` is ``(out, in)``, jaxact's kernels are
``(in, out)``, so every matrix is transposed; the fused ``gate_up_proj`` is split, gate rows first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

_FN = "jaxact.moe_params_from_transformers"

# The per-expert names of (gate, up, down) in the checkpoints before transformers 5.
_PER_EXPERT = {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral
_PER_EXPERT |= {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen2/3-MoE, DeepSeek


def _fail(message: str, keys) -> None:
  shown = ", ".join(sorted(keys)[:12]) or "none"
  raise ValueError(f"{_FN}: {message} (the keys under the prefix: {shown})")


def _transpose(w: Array) -> Array:
  return jnp.swapaxes(w, -1, -2)


def moe_params_from_transformers(
  state_dict: Mapping[str, ArrayLike], prefix: str = ""
) -> dict[str, Array]:
  """One transformers MoE block's parameters as the keyword arguments of :func:`jaxact.moe_mlp`.

  Reads, under ``prefix`` (the block's module path, such as ``"model.layers.3.mlp."``; a missing
  final dot is added), the router ``gate.weight`` ``(E, H)`` and the experts in either layout:

  - transformers 5, fused: ``experts.gate_up_proj`` ``(E, 2I, H)``, the gate's rows first, and
    ``experts.down_proj`` ``(E, H, I)``;
  - the per-expert ``torch.nn.Linear`` weights ``(out, in)`` of older checkpoints:
    ``experts.{e}.w1.weight`` (gate), ``w3`` (up), ``w2`` (down) (Mixtral), or
    ``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj`` (Qwen2-MoE, Qwen3-MoE,
    DeepSeek-V3);

  and DeepSeek-V3's ``gate.e_score_correction_bias`` ``(E,)`` where there is one. Other keys (the
  shared experts, other layers) are ignored. Pure array code: numpy or JAX arrays in (from
  ``safetensors.safe_open(..., framework="flax")`` or ``"numpy"``; ``tensor.numpy()`` of torch's),
  JAX arrays of the same dtype out.

  Returns:
    ``{"router": (H, E), "w_gate": (E, H, I), "w_up": (E, H, I), "w_down": (E, I, H)}``, plus
    ``"router_bias": (E,)`` for DeepSeek-V3: ``jaxact.moe_mlp(x, **params, top_k=...)``. The
    routing options are the model config's (``docs/moe.md`` has the table): DeepSeek-V3's
    ``n_group`` and ``topk_group`` are ``expert_groups`` and ``top_k_groups``.

  Raises:
    ValueError: a key is missing, the shapes disagree, or the block is gpt-oss's (biased,
      interleaved experts, which :func:`jaxact.moe_mlp` does not model).

  Examples:
    >>> import numpy as np, jaxact
    >>> sd = {"mlp.gate.weight": np.ones((4, 8)), "mlp.experts.gate_up_proj": np.ones((4, 32, 8)),
    ...       "mlp.experts.down_proj": np.ones((4, 8, 16))}
    >>> params = jaxact.moe_params_from_transformers(sd, prefix="mlp")
    >>> {k: v.shape for k, v in params.items()}
    {'router': (8, 4), 'w_gate': (4, 8, 16), 'w_up': (4, 8, 16), 'w_down': (4, 16, 8)}
  """
  if not isinstance(state_dict, Mapping):
    raise TypeError(
      f"{_FN}: `state_dict` must be a mapping of names to arrays; got {type(state_dict).__name__}"
    )
  if not isinstance(prefix, str):
    raise TypeError(f"{_FN}: `prefix` must be a str; got {type(prefix).__name__}")
  if prefix and not prefix.endswith("."):
    prefix += "."
  keys = {k[len(prefix) :]: k for k in state_dict if isinstance(k, str) and k.startswith(prefix)}

  def get(name):
    return jnp.asarray(state_dict[keys[name]])

  if "gate.weight" not in keys:
    _fail(f"`state_dict` has no router {prefix + 'gate.weight'!r}", keys)
  if "experts.gate_up_proj_bias" in keys or "router.weight" in keys:
    _fail("gpt-oss's experts (biased, gate and up interleaved) are not modelled", keys)
  gate = get("gate.weight")
  if gate.ndim != 2:
    _fail(f"`gate.weight` must be (experts, hidden); got shape {gate.shape}", keys)
  e, h = gate.shape
  if "experts.gate_up_proj" in keys:
    gate_up, down = get("experts.gate_up_proj"), get("experts.down_proj")
    if gate_up.ndim != 3 or gate_up.shape[0] != e or gate_up.shape[2] != h or gate_up.shape[1] % 2:
      _fail(
        f"`experts.gate_up_proj` must be ({e}, 2 * intermediate, {h}); got {gate_up.shape}", keys
      )
    i = gate_up.shape[1] // 2
    if down.shape != (e, h, i):
      _fail(f"`experts.down_proj` must be ({e}, {h}, {i}); got {down.shape}", keys)
    w_gate, w_up = _transpose(gate_up[:, :i]), _transpose(gate_up[:, i:])
    w_down = _transpose(down)
  else:
    found: dict[str, dict[int, str]] = {"gate": {}, "up": {}, "down": {}}
    pattern = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
    for key in keys:
      m = pattern.fullmatch(key)
      if m and m.group(2) in _PER_EXPERT:
        found[_PER_EXPERT[m.group(2)]][int(m.group(1))] = key
    if not found["gate"]:
      _fail(
        "`state_dict` has no experts: neither `experts.gate_up_proj` (transformers 5) nor "
        "`experts.{e}.w1.weight` / `experts.{e}.gate_proj.weight`",
        keys,
      )
    stacked = {}
    for role, by_expert in found.items():
      missing = [n for n in range(e) if n not in by_expert]
      if missing or len(by_expert) != e:
        _fail(
          f"the router has {e} experts but the {role} weights of experts {missing} are missing "
          f"or there are others ({sorted(by_expert)})",
          keys,
        )
      mats = [jnp.asarray(state_dict[keys[by_expert[n]]]) for n in range(e)]
      if len({m.shape for m in mats}) != 1:
        _fail(f"the experts' {role} weights differ in shape", keys)
      stacked[role] = _transpose(jnp.stack(mats))
    w_gate, w_up, w_down = stacked["gate"], stacked["up"], stacked["down"]
    i = w_gate.shape[2]
    if w_gate.shape != (e, h, i) or w_up.shape != (e, h, i) or w_down.shape != (e, i, h):
      _fail(
        f"the experts' weights must be gate and up ({i}, {h}), down ({h}, {i}) as torch Linear "
        f"weights; got gate {w_gate.shape}, up {w_up.shape}, down {w_down.shape} transposed",
        keys,
      )
  params = {"router": _transpose(gate), "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
  if "gate.e_score_correction_bias" in keys:
    bias = get("gate.e_score_correction_bias")
    if bias.shape != (e,):
      _fail(f"`gate.e_score_correction_bias` must be ({e},); got {bias.shape}", keys)
    params["router_bias"] = bias
  return params
