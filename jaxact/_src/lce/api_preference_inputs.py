"""The inputs of :func:`jaxact._src.lce.api_preference.preference_loss`: the checks of its arrays,
the policy's per-token log-probabilities of both completions (one
:func:`~jaxact._src.lce.api_log_probs.linear_log_probs` call over their tokens concatenated along
the sequence axis where it can), the reference's sequence sums (passed in or computed here,
detached) and the given scalars (KTO's reference point, BCO's reward shift)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.core import args, shardings, validation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import api_preference_losses as losses
from jaxact._src.lce.api_log_probs import log_probs

_FN = "preference_loss"


def err(msg: str) -> str:
  return checks.err(_FN, msg)


def tokens(tokens, name: str) -> Array:
  tokens = checks.as_labels(_FN, tokens, name)
  if tokens.ndim < 1:
    raise ValueError(err(f"`{name}` must have rank >= 1 (..., sequence); got shape {tokens.shape}"))
  return tokens


def mask(mask, shape, name: str, of: str) -> Array:
  if mask is None:
    return jnp.ones(shape, bool)
  return checks.as_where(_FN, mask, shape, of, name=name)


def hidden(x: Array, tokens: Array, name: str, of: str, features: int | None) -> None:
  if x.ndim != tokens.ndim + 1 or x.shape[:-1] != tokens.shape:
    raise ValueError(
      err(
        f"`{name}` must have shape {of}.shape + (features,) = {tokens.shape} + (D,); got "
        f"{name}.shape={x.shape}, {of}.shape={tokens.shape}"
      )
    )
  if features is not None and x.shape[-1] != features:
    raise ValueError(
      err(f"`{name}` has {x.shape[-1]} features but `w` expects {features} (w.shape given)")
    )


def features(w: Array, layout: str, name: str) -> int:
  if w.ndim != 2:
    axes = "(features, vocabulary)" if layout == "dv" else "(vocabulary, features)"
    raise ValueError(err(f"`{name}` must have rank 2 {axes}; got shape {w.shape}"))
  return w.shape[0] if layout == "dv" else w.shape[1]


def per_token(x_c, x_r, w, b, t_c, t_r, m_c, m_r, options) -> tuple[Array, Array]:
  """Per-token log-probs of both completions (0 where masked), each of its tokens' shape: one
  :func:`jaxact.linear_log_probs` call over their tokens concatenated along the sequence axis
  where the batch shapes agree (the batch axes, and their data-parallel sharding, kept: no
  device's rows move), else (KTO's unpaired batches, or a sequence axis split over devices) one
  call each."""
  spec = shardings.spec(x_c)
  if t_c.shape[:-1] == t_r.shape[:-1] and (spec is None or not spec[-2]):
    if spec is not None:  # the same sharding on both sides, as the concatenation needs
      x_r = shardings.to_spec(x_r, spec)
      t_c, t_r, m_c, m_r = (shardings.to_spec(a, spec[:-1]) for a in (t_c, t_r, m_c, m_r))
    x = jnp.concatenate([x_c, x_r], axis=-2)
    tokens = jnp.concatenate([t_c, t_r], axis=-1)
    where = jnp.concatenate([m_c, m_r], axis=-1)
    logp = log_probs(_FN, x, w, tokens, bias=b, where=where, **options)
    n = t_c.shape[-1]
    return logp[..., :n], logp[..., n:]
  return tuple(
    log_probs(_FN, x, w, t, bias=b, where=m, **options)
    for x, t, m in ((x_c, t_c, m_c), (x_r, t_r, m_r))
  )


# The detached scalars a loss may be given: the argument, its loss, and what it is.
_GIVEN = {
  "kto_kl": ("kto", "KTO's reference point"),
  "bco_reward_mean": ("bco_pair", "BCO's reward shift"),
}


def given(loss: str, name: str, value, acc) -> Array | None:
  """``kto_kl`` or ``bco_reward_mean``: a floating-point scalar, detached, for its loss only."""
  if value is None:
    return None
  taker, what = _GIVEN[name]
  if loss != taker:
    raise ValueError(err(f"`{name}` is {what}; loss={loss!r} takes None"))
  v = validation.as_real_array(_FN, value, name)
  if v.shape != () or not validation.is_floating(v.dtype):
    raise ValueError(
      err(f"`{name}` must be a floating-point scalar; got shape {v.shape}, dtype {v.dtype}")
    )
  return lax.stop_gradient(v.astype(acc))


def reference(loss, batch, given, inputs, options, weights) -> tuple[Array, Array] | None:
  """The reference's sequence log-probabilities (chosen, rejected), detached: passed in
  (`given`), computed from its hidden states and head (`inputs`), or None for the reference-free
  losses; an error where the loss and what is passed disagree. Computed sums weight each token
  by `weights` (LD-DPO's, as the policy's)."""
  t_c, t_r, m_c, m_r, vocab, acc = batch
  names = ("ref_chosen_log_probs", "ref_rejected_log_probs")
  in_names = ("ref_x_chosen", "ref_x_rejected", "ref_w", "ref_bias")
  passed = [n for n, a in zip(names + in_names, given + inputs, strict=True) if a is not None]
  if loss not in losses.REFERENCED:
    if passed:
      raise ValueError(
        err(f"loss={loss!r} is reference-free; it takes no {', '.join(f'`{n}`' for n in passed)}")
      )
    return None
  if any(a is not None for a in given):
    if any(a is not None for a in inputs):
      raise ValueError(
        err(
          "pass the reference's log-probabilities (`ref_chosen_log_probs`, "
          "`ref_rejected_log_probs`) or its inputs (`ref_x_chosen`, `ref_x_rejected`, `ref_w`), "
          f"not both; got {', '.join(f'`{n}`' for n in passed)}"
        )
      )
    out = []
    for name, a, t in zip(names, given, (t_c, t_r), strict=True):
      if a is None:
        raise ValueError(err(f"`{name}` is missing: loss={loss!r} needs both reference sums"))
      a = validation.as_real_array(_FN, a, name)
      if not validation.is_floating(a.dtype) or a.shape != t.shape[:-1]:
        raise ValueError(
          err(
            f"`{name}` must be floating point of the batch shape {t.shape[:-1]} (one sum a "
            f"sequence); got shape {a.shape}, dtype {a.dtype}"
          )
        )
      out.append(lax.stop_gradient(a.astype(acc)))
    return out[0], out[1]
  x_c, x_r, w, b = inputs
  for name, a in zip(in_names[:3], inputs[:3], strict=True):
    if a is None:
      raise ValueError(
        err(
          f"loss={loss!r} needs the reference: pass `ref_chosen_log_probs` and "
          "`ref_rejected_log_probs`, or `ref_x_chosen`, `ref_x_rejected` and `ref_w`"
          + ("" if not passed else f" (`{name}` is missing)")
        )
      )
  arrays, _, _ = args.prepare_arrays(
    _FN, {"ref_x_chosen": x_c, "ref_x_rejected": x_r, "ref_w": w, "ref_bias": b}, None
  )
  x_c, x_r, w, b = (lax.stop_gradient(a) if a is not None else None for a in arrays.values())
  d = features(w, options["w_layout"], "ref_w")
  hidden(x_c, t_c, "ref_x_chosen", "chosen_tokens", d)
  hidden(x_r, t_r, "ref_x_rejected", "rejected_tokens", d)
  ref_vocab = w.shape[1] if options["w_layout"] == "dv" else w.shape[0]
  if ref_vocab != vocab or (b is not None and b.shape != (vocab,)):
    raise ValueError(
      err(
        f"the reference's head must have the policy's vocabulary ({vocab}); got ref_w.shape="
        f"{w.shape}" + ("" if b is None else f", ref_bias.shape={b.shape}")
      )
    )
  if t_c.size + t_r.size == 0:
    return jnp.zeros(t_c.shape[:-1], acc), jnp.zeros(t_r.shape[:-1], acc)
  lp_c, lp_r = per_token(x_c, x_r, w, b, t_c, t_r, m_c, m_r, options)
  return tuple(
    lax.stop_gradient(jnp.sum(lp * wt, -1).astype(acc))
    for lp, wt in zip((lp_c, lp_r), weights, strict=True)
  )
