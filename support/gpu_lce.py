"""What the LM head's GPU section times and the GPU truth run checks, built where tests reach it.

``python -m benchmarks gpu --sections lce`` (``benchmarks/gpu/lce.py``) times the paths of
:func:`paths`; ``tests/lce/test_lce_mosaic.py`` lowers each of them for an abstract H100, so
that the section a GPU session runs has been traced before. :func:`check` runs the loss with each
of :data:`OPTION_CASES` through a kernel path against the XLA path (``--truth``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from support.gpu_compare import Comparison, compare_to_xla

try:
  import tokamax
except ImportError:  # a comparison in the benchmark, not a dependency
  tokamax = None


def plain(x, w, labels):
  """What a JAX user writes: float32 logits, then optax's loss."""
  import optax

  logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mosaic_forward_only(x, w, labels):
  """``implementation="mosaic"`` with XLA's blocked backward in place of the backward kernel: what
  the two kernels are each worth, apart."""
  from jaxact._src.core import dispatch
  from jaxact._src.lce.plan import LcePlan, default_block, kernel_block
  from jaxact._src.lce.vjp import per_token_loss

  tokens, vocab = x.shape[0], w.shape[1]
  plan = LcePlan(
    block=kernel_block(default_block(tokens, vocab, "gpu"), vocab),
    decision=dispatch.Decision("mosaic", "xla", forced=True, target=dispatch.target()),
  )
  return per_token_loss(plan, x, w, None, labels.astype(jnp.int32), None).mean()


def paths(hopper: bool) -> dict[str, Callable]:
  """label: ``loss(x, w, labels)`` for every path the section times (the Mosaic GPU ones, both
  kernels and the forward kernel alone, on Hopper only; tokamax's where it imports)."""
  out: dict[str, Callable] = {
    "plain": plain,
    "jaxact xla": functools.partial(jaxact.linear_cross_entropy, implementation="xla"),
  }
  if hopper:
    out["jaxact mosaic"] = functools.partial(jaxact.linear_cross_entropy, implementation="mosaic")
    out["jaxact mosaic fwd"] = mosaic_forward_only
  if tokamax is not None:
    out["tokamax"] = lambda x, w, labels: tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="mean"
    )
  return out


# ------------------------------------------------------------------ the truth run's checks

# label: the options of one check of implementation="mosaic" against "xla" (bias: a (V,) bias with
# every seventh entry masked by -inf; where: a quarter of the tokens left out).
OPTION_CASES: dict[str, dict] = {
  "plain": {},
  "bias": {"bias": True},
  "where": {"where": True},
  "smoothing": {"label_smoothing": 0.1},
  "z-loss": {"z_loss": 1e-3},
  "soft-cap": {"logit_soft_cap": 10.0},
  "all, sum": {
    "bias": True,
    "where": True,
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "logit_soft_cap": 10.0,
    "reduction": "sum",
  },
  "all, none": {
    "bias": True,
    "where": True,
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "logit_soft_cap": 10.0,
    "reduction": "none",
  },
}


def check(case: str, implementation: str, shape, dtype, seed: int = 0) -> Comparison:
  """``linear_cross_entropy`` of ``shape = (tokens, D, V)`` with :data:`OPTION_CASES`'s `case`
  through `implementation` against XLA's: the loss (or the per-token losses) and the gradients of
  x, w and the bias (:func:`support.gpu_compare.compare_to_xla`)."""
  options = dict(OPTION_CASES[case])
  with_bias, with_where = options.pop("bias", False), options.pop("where", False)
  tokens, dim, vocab = shape
  k = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(k[0], (tokens, dim), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (dim, vocab), jnp.float32) * 2 / np.sqrt(dim)).astype(dtype)
  labels = jax.random.randint(k[2], (tokens,), 0, vocab, jnp.int32)
  args, names = [x, w], ["loss", "dx", "dw"]
  if with_bias:
    b = jax.random.normal(k[3], (vocab,), jnp.float32).at[::7].set(-jnp.inf).astype(dtype)
    # no label on a masked entry
    labels = jnp.where(labels % 7, labels, jnp.where(labels + 1 < vocab, labels + 1, labels - 1))
    args.append(b)
    names.append("db")
  where = jax.random.bernoulli(k[4], 0.75, (tokens,)) if with_where else None

  def build(impl, precision):
    def f(x, w, b=None):
      return jaxact.linear_cross_entropy(
        x, w, labels, bias=b, where=where, precision=precision, implementation=impl, **options
      )

    return f

  return compare_to_xla(build, args, implementation, names=names, seed=seed + 1)
