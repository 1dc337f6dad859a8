"""Gated linear units and the gated MLP of transformers, keeping two hidden-sized arrays a layer.

``gated_dense`` is ``act(x @ w_gate + b_gate) * (x @ w_up + b_up)`` (SwiGLU with silu, GeGLU with
gelu, ReGLU with relu, GLU with sigmoid); ``gated_mlp`` adds the down projection, the whole MLP
block of Llama, Gemma, Mistral or PaLM. Each is one ``custom_vjp`` (:mod:`jaxact._src.gated.vjp`).
This module checks the arguments and builds the call's static plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike, DTypeLike

from jaxact._src.activations.resolve import resolve_activation
from jaxact._src.core import args, dispatch, dropout, shardings
from jaxact._src.core.dispatch import Implementation
from jaxact._src.gated import rules
from jaxact._src.gated.plan import GatedPlan
from jaxact._src.gated.vjp import gated

# What a gated op may keep between the passes (its `residuals` argument).
RESIDUALS = ("projections", "input")


def _check_shapes(fn_name, x, w_gate, w_up, w_down, b_gate, b_up, b_down) -> None:
  def shapes():
    named = [("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)]
    return ", ".join(f"{n}.shape={v.shape}" for n, v in named if v is not None)

  if x.ndim < 1:
    raise ValueError(f"jaxact.{fn_name}: `x` must have rank >= 1 (..., features); got {shapes()}")
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w is not None and w.ndim != 2:
      raise ValueError(
        f"jaxact.{fn_name}: `{name}` must have rank 2 (in, out); got rank {w.ndim} ({shapes()})"
      )
  if x.shape[-1] != w_gate.shape[0]:
    raise ValueError(
      f"jaxact.{fn_name}: `x` has {x.shape[-1]} features but `w_gate` expects {w_gate.shape[0]} "
      f"({shapes()})"
    )
  if w_up.shape != w_gate.shape:
    raise ValueError(
      f"jaxact.{fn_name}: `w_up` must have the shape of `w_gate` (in, hidden); got {shapes()}"
    )
  hidden = w_gate.shape[1]
  if w_down is not None and w_down.shape[0] != hidden:
    raise ValueError(
      f"jaxact.{fn_name}: `w_down` takes {w_down.shape[0]} features but the hidden layer has "
      f"{hidden} (w_gate's and w_up's last dim) ({shapes()})"
    )
  for name, bias, n in (
    ("b_gate", b_gate, hidden),
    ("b_up", b_up, hidden),
    ("b_down", b_down, None if w_down is None else w_down.shape[1]),
  ):
    if bias is not None and bias.shape != (n,):
      raise ValueError(
        f"jaxact.{fn_name}: `{name}` has shape {bias.shape}; accepted: shape ({n},) or None "
        f"({shapes()})"
      )


def _sharded_plan(fn_name: str, plan: GatedPlan, x, w_gate, w_up, w_down, out_sharding, arrays):
  """`plan` with the shardings of its products (Explicit mesh axes): the hidden's (the caller's
  for gated_dense; where jax infers none, x's rows and w_gate's columns), y's (the caller's), the
  gathers of x and h, the primals' specs."""
  out_sharding = shardings.typed(out_sharding)
  hidden = out_sharding if not plan.has_down else None
  if hidden is None and (shardings.spec(x) is not None or shardings.spec(w_gate) is not None):
    hidden = shardings.inferred_or_rows_by_columns(x, w_gate)
  x_gather = shardings.product_input(x, x.ndim - 1, w_gate, 0)
  h_gather = None
  if plan.has_down:
    x_in = x if x_gather is None else shardings.struct(x, x_gather)

    def h_of(x, w):
      return _project_shape(plan, x, w, hidden)

    h = shardings.product_shape(fn_name, h_of, x_in, w_gate)
    h_gather = shardings.product_input(h, h.ndim - 1, w_down, 0)
    h_in = h if h_gather is None else shardings.struct(h, h_gather)
    shardings.product_shape(
      fn_name, lambda h, w: _project_shape(plan, h, w, out_sharding), h_in, w_down
    )
  return dataclasses.replace(
    plan,
    hidden_sharding=hidden,
    out_sharding=out_sharding if plan.has_down else None,
    x_gather=x_gather,
    h_gather=h_gather,
    shardings=shardings.specs(*arrays),
  )


def _project_shape(plan: GatedPlan, x, w, out_sharding):
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  return lax.dot_general(x, w, dims, plan.precision, out_sharding=out_sharding)


def _run(
  fn_name,
  arrays,
  activation,
  precision,
  preferred_element_type,
  implementation,
  drop=(0.0, None, ()),
  out_sharding=None,
  residuals="projections",
):
  dispatch.check_implementation(fn_name, implementation)
  if residuals not in RESIDUALS:
    raise ValueError(
      f"jaxact.{fn_name}: `residuals` {residuals!r} is not known; choose one of: "
      f"{', '.join(map(repr, RESIDUALS))}"
    )
  prepared, acc, out = args.prepare_arrays(fn_name, arrays, preferred_element_type)
  x, w_gate, w_up, w_down, b_gate, b_up, b_down = prepared.values()
  _check_shapes(fn_name, x, w_gate, w_up, w_down, b_gate, b_up, b_down)
  out_sharding = shardings.check(fn_name, out_sharding, x.ndim)
  drop, key = dropout.check(fn_name, *drop, max(x.ndim, 1))
  a_shape = jax.ShapeDtypeStruct((*x.shape[:-1], w_gate.shape[1]), acc)
  act, dynamic = resolve_activation(fn_name, activation, a_shape, out)
  if act.rule is not None and act.rule.code is not None:
    raise ValueError(
      f"jaxact.{fn_name}: `activation` asks for residual_bits={act.rule.code.bits}, but the gated "
      "ops keep the gate's pre-activation a anyway (the up projection's gradient needs act(a)), so "
      "a derivative code would save nothing; drop residual_bits"
    )
  if act.fn is not None:
    got = jax.eval_shape(act.fn, jax.ShapeDtypeStruct(a_shape.shape, out), *dynamic)
    if got.shape != a_shape.shape:
      raise ValueError(
        f"jaxact.{fn_name}: `activation` must keep the gate's shape {a_shape.shape} (it is "
        f"multiplied elementwise by the up projection); it returns shape {got.shape}"
      )
  plan = GatedPlan(
    act=act,
    precision=args.hashable_precision(precision),
    acc_dtype=acc,
    out_dtype=out,
    has_gate_bias=b_gate is not None,
    has_up_bias=b_up is not None,
    has_down=w_down is not None,
    has_down_bias=b_down is not None,
    dropout=drop,
    residuals=residuals,
  )
  plan = _sharded_plan(fn_name, plan, x, w_gate, w_up, w_down, out_sharding, prepared.values())
  decision = rules.decide(fn_name, implementation, plan, x, w_gate, w_up)
  plan = dataclasses.replace(plan, decision=decision)
  rows = rules.backward_rows(plan, math.prod(x.shape[:-1]), w_gate.dtype)
  plan = dataclasses.replace(plan, backward_rows=rows)
  y = gated(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic)
  return shardings.constrain(y, out_sharding)


def gated_dense(
  x: ArrayLike,
  w_gate: ArrayLike,
  w_up: ArrayLike,
  b_gate: ArrayLike | None = None,
  b_up: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array] = "silu",
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
  out_sharding: NamedSharding | PartitionSpec | None = None,
  residuals: Literal["projections", "input"] = "projections",
) -> Array:
  r"""Gated linear unit: two projections of ``x``, one through an activation, multiplied.

  Computes

  .. math::
    h = \mathrm{act}(\underbrace{x W_g + b_g}_{a}) \odot (\underbrace{x W_u + b_u}_{b})

  as one op that keeps ``a`` and ``b`` (plus ``x`` and the weights, which the weight gradients
  need anyway) for the backward pass. ``act(a)`` and ``act'(a)`` are recomputed there:
  :math:`\bar a = \bar h \odot \mathrm{act}'(a) \odot b`, :math:`\bar b = \bar h \odot
  \mathrm{act}(a)`. With ``activation="silu"`` this is SwiGLU, ``"gelu"`` GeGLU (``partial(gelu,
  approximate=False)`` for the exact form), ``"relu"`` ReGLU and ``"sigmoid"`` the original GLU.

  ``activation`` is taken as :func:`jaxact.dense_bias_act` takes it: a name, a jaxact function, a
  :mod:`jax.nn` function, a ``functools.partial`` of either with keyword parameters (jaxact's
  derivative is used), or any other callable that keeps its input's shape (differentiated by
  JAX's autodiff, in the output dtype).
  Dtypes and ``precision`` as :func:`jaxact.dense_bias_act`: half precision accumulates and
  evaluates the activation in float32 and keeps ``a`` and ``b`` in its own dtype.

  Args:
    x: input of shape ``(..., in)``, floating point.
    w_gate: gate kernel of shape ``(in, hidden)``.
    w_up: up kernel of shape ``(in, hidden)``.
    b_gate: gate bias of shape ``(hidden,)``, or None.
    b_up: up bias of shape ``(hidden,)``, or None.
    activation: the gate's activation (default ``"silu"``: SwiGLU).
    precision: passed to :func:`jax.lax.dot_general` in the forward and backward passes.
    preferred_element_type: dtype of the result (and of the kept ``a`` and ``b``).
    implementation: ``None`` (the best available: XLA until a GPU measurement says otherwise,
      see the dispatch docs), ``"xla"``, ``"pallas"`` (the Triton kernels: both projections from
      one pass over x with the gated epilogue, and a one-pass backward for da and db) or
      ``"mosaic"`` (the Hopper forward with the Triton backward; bfloat16/float16, ``M`` a
      multiple of 128, ``hidden`` of 128, ``in`` of 64). Kernels run in interpret mode off CUDA;
      calls they do not support raise ``NotImplementedError``.
    out_sharding: ``h``'s sharding, as ``jnp.dot`` takes it (see
      :func:`jaxact.dense_bias_act`); both projections give it. None: what jax infers for
      ``x @ w_gate``, or where it infers none (both contraction dimensions sharded), ``x``'s rows
      and ``w_gate``'s columns.
    residuals: what the op keeps for the backward pass: ``"projections"`` (default: ``x``, ``a``
      and ``b``) or ``"input"`` (``x`` alone; ``a`` and ``b`` are recomputed in the backward pass,
      see :func:`gated_mlp`).

  Returns:
    ``h`` of shape ``(..., hidden)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 2.0]])
    >>> w_gate, w_up = jnp.array([[1.0], [1.0]]), jnp.array([[0.5], [0.0]])
    >>> jaxact.gated_dense(x, w_gate, w_up, activation="relu").tolist()
    [[1.5]]
  """
  fn_name = "gated_dense"
  with jax.named_scope(f"jaxact.{fn_name}"):
    arrays = {
      "x": x,
      "w_gate": w_gate,
      "w_up": w_up,
      "w_down": None,
      "b_gate": b_gate,
      "b_up": b_up,
      "b_down": None,
    }
    return _run(
      fn_name,
      arrays,
      activation,
      precision,
      preferred_element_type,
      implementation,
      out_sharding=out_sharding,
      residuals=residuals,
    )


def gated_mlp(
  x: ArrayLike,
  w_gate: ArrayLike,
  w_up: ArrayLike,
  w_down: ArrayLike,
  b_gate: ArrayLike | None = None,
  b_up: ArrayLike | None = None,
  b_down: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array] = "silu",
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: ArrayLike | None = None,
  dropout_broadcast_dims: Sequence[int] = (),
  out_sharding: NamedSharding | PartitionSpec | None = None,
  residuals: Literal["projections", "input"] = "projections",
) -> Array:
  r"""The gated MLP block of transformers (Llama's, Gemma's, PaLM's), keeping ``x``, ``a``, ``b``.

  Computes

  .. math::
    y = \bigl(\mathrm{act}(x W_g + b_g) \odot (x W_u + b_u)\bigr) W_d + b_d

  as one op. Between the forward and the backward pass it keeps the input ``x``, the two
  projections ``a = x W_g + b_g`` and ``b = x W_u + b_u`` and the weights, nothing else: the hidden
  ``h = act(a) * b``, which the down projection's weight gradient needs, is recomputed from ``a``
  and ``b`` in the backward pass. Autodiff of the same composition keeps ``act(a)``, ``h`` and the
  activation's intermediates besides (about six hidden-sized arrays for silu).

  ``activation``, dtypes and ``precision`` as :func:`gated_dense`.

  With ``dropout_rate > 0`` the hidden ``h`` is dropped out before the down projection (T5 v1.1's
  and Gemma's place for the MLP's dropout), exactly as ``nn.Dropout(rate)(h, rng=dropout_rng)``:
  ``select(mask, h / (1 - rate), 0)`` with ``mask = jax.random.bernoulli(dropout_rng, 1 - rate,
  h.shape)``. The op keeps the key, not the mask (nor the dropped ``h``): the backward pass draws
  the mask again (see :func:`jaxact.dense_bias_act`). Dropout runs on XLA's path; the kernels
  draw no masks (``implementation="pallas"`` / ``"mosaic"`` raise ``NotImplementedError`` with it).

  Args:
    x: input of shape ``(..., in)``, floating point.
    w_gate: gate kernel of shape ``(in, hidden)``.
    w_up: up kernel of shape ``(in, hidden)``.
    w_down: down kernel of shape ``(hidden, out)``.
    b_gate: gate bias of shape ``(hidden,)``, or None.
    b_up: up bias of shape ``(hidden,)``, or None.
    b_down: down bias of shape ``(out,)``, or None.
    activation: the gate's activation (default ``"silu"``: a SwiGLU MLP).
    precision: passed to :func:`jax.lax.dot_general` in the forward and backward passes.
    preferred_element_type: dtype of the result (and of the kept ``a`` and ``b``).
    implementation: ``None`` (the best available: XLA until a GPU measurement says otherwise,
      see the dispatch docs), ``"xla"``, ``"pallas"`` (the Triton kernels: both projections from
      one pass over x with the gated epilogue, and a one-pass backward for da and db) or
      ``"mosaic"`` (the Hopper forward with the Triton backward; bfloat16/float16, ``M`` a
      multiple of 128, ``hidden`` of 128, ``in`` of 64). Kernels run in interpret mode off CUDA;
      calls they do not support raise ``NotImplementedError``.
    dropout_rate: the probability of dropping an element of the hidden ``h`` (default 0: none).
    dropout_rng: the dropout's PRNG key (``jax.random.key``, or a raw ``jax.random.PRNGKey``);
      required when ``dropout_rate > 0``.
    dropout_broadcast_dims: axes of ``h`` that share one mask, as ``nn.Dropout``'s
      ``broadcast_dims``.
    out_sharding: ``y``'s sharding, as ``jnp.dot`` takes it (see
      :func:`jaxact.dense_bias_act`): under Explicit mesh axes needed where ``h``'s and
      ``w_down``'s contraction dimensions are both sharded (Megatron's row-parallel down
      projection, FSDP weights). The hidden ``a``, ``b``, ``h`` are split as jax infers for
      ``x @ w_gate``, or where it infers none, as ``x``'s rows and ``w_gate``'s columns (Gemma's
      ``act_btf`` for its ``act_btd`` input and ``(fsdp, tensor)`` weights). Each gradient has
      its input's sharding.
    residuals: what the op keeps for the backward pass: ``"projections"`` (default: ``x``, ``a``
      and ``b``) or ``"input"``: ``x`` alone, the gate and up projections recomputed in the
      backward pass (two more matmuls beside the nine of the forward and backward), in blocks of
      tokens where the backward runs in blocks, so no whole ``(tokens, hidden)`` array is made
      there. In a Llama block (hidden 2.75x the width) that drops 5.5 of the 6.5 width-sized
      arrays the op keeps a token.

  Returns:
    ``y`` of shape ``(..., out)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 2.0]])
    >>> w_gate, w_up = jnp.array([[1.0], [1.0]]), jnp.array([[0.5], [0.0]])
    >>> w_down = jnp.array([[2.0, -1.0]])
    >>> jaxact.gated_mlp(x, w_gate, w_up, w_down, activation="relu").tolist()
    [[3.0, -1.5]]
  """
  fn_name = "gated_mlp"
  with jax.named_scope(f"jaxact.{fn_name}"):
    arrays = {
      "x": x,
      "w_gate": w_gate,
      "w_up": w_up,
      "w_down": w_down,
      "b_gate": b_gate,
      "b_up": b_up,
      "b_down": b_down,
    }
    drop = (dropout_rate, dropout_rng, dropout_broadcast_dims)
    return _run(
      fn_name,
      arrays,
      activation,
      precision,
      preferred_element_type,
      implementation,
      drop,
      out_sharding,
      residuals,
    )
