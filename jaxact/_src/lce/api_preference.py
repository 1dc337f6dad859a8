"""The preference losses of post-training from the hidden states and the LM head, without the
logits: :func:`preference_loss` (DPO, IPO, hinge, robust DPO, SimPO, ORPO, CPO, KTO).

Every loss is a function of each completion's sequence log-probability, the sum (or, for IPO,
SimPO and ORPO, the mean) of its tokens' :func:`jaxact.linear_log_probs` over the completion's
mask. Chosen and rejected completions (and the reference's, when computed in the call) go through
one :func:`~jaxact._src.lce.api_log_probs.linear_log_probs` call each, their tokens concatenated
along the sequence axis (the batch's data-parallel sharding kept), so one vocabulary loop a pass
serves both; the losses' own arithmetic is on (batch,) numbers and
lives in :mod:`jaxact._src.lce.api_preference_losses`.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import args, dispatch, shardings, validation
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import api_preference_losses as losses
from jaxact._src.lce.api_log_probs import log_probs

_FN = "preference_loss"
Loss = Literal["dpo", "ipo", "hinge", "robust", "simpo", "orpo", "cpo", "kto"]


def _err(msg: str) -> str:
  return checks.err(_FN, msg)


def _tokens(tokens, name: str) -> Array:
  tokens = checks.as_labels(_FN, tokens, name)
  if tokens.ndim < 1:
    raise ValueError(
      _err(f"`{name}` must have rank >= 1 (..., sequence); got shape {tokens.shape}")
    )
  return tokens


def _mask(mask, shape, name: str, of: str) -> Array:
  if mask is None:
    return jnp.ones(shape, bool)
  return checks.as_where(_FN, mask, shape, of, name=name)


def _hidden(x: Array, tokens: Array, name: str, of: str, features: int | None) -> None:
  if x.ndim != tokens.ndim + 1 or x.shape[:-1] != tokens.shape:
    raise ValueError(
      _err(
        f"`{name}` must have shape {of}.shape + (features,) = {tokens.shape} + (D,); got "
        f"{name}.shape={x.shape}, {of}.shape={tokens.shape}"
      )
    )
  if features is not None and x.shape[-1] != features:
    raise ValueError(
      _err(f"`{name}` has {x.shape[-1]} features but `w` expects {features} (w.shape given)")
    )


def _features(w: Array, layout: str, name: str) -> int:
  if w.ndim != 2:
    axes = "(features, vocabulary)" if layout == "dv" else "(vocabulary, features)"
    raise ValueError(_err(f"`{name}` must have rank 2 {axes}; got shape {w.shape}"))
  return w.shape[0] if layout == "dv" else w.shape[1]


def _per_token(x_c, x_r, w, b, t_c, t_r, m_c, m_r, options) -> tuple[Array, Array]:
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


def preference_loss(
  x_chosen: ArrayLike,
  x_rejected: ArrayLike,
  w: ArrayLike,
  chosen_tokens: ArrayLike,
  rejected_tokens: ArrayLike,
  *,
  chosen_mask: ArrayLike | None = None,
  rejected_mask: ArrayLike | None = None,
  loss: Loss = "dpo",
  beta: float = 0.1,
  label_smoothing: float = 0.0,
  simpo_gamma: float = 0.5,
  nll_weight: float = 1.0,
  desirable_weight: float = 1.0,
  undesirable_weight: float = 1.0,
  kto_kl: ArrayLike | None = None,
  ref_chosen_log_probs: ArrayLike | None = None,
  ref_rejected_log_probs: ArrayLike | None = None,
  ref_x_chosen: ArrayLike | None = None,
  ref_x_rejected: ArrayLike | None = None,
  ref_w: ArrayLike | None = None,
  ref_bias: ArrayLike | None = None,
  bias: ArrayLike | None = None,
  temperature: float = 1.0,
  logit_soft_cap: float | None = None,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""A preference loss of the policy head ``(x, w)`` over chosen and rejected completions,
  without the logits; returns ``(loss, metrics)``.

  Each completion's log-probability is :math:`\pi = \sum_t \log p(y_t \mid x_t)` over its
  mask's positions (:func:`jaxact.linear_log_probs`; the reference's :math:`\pi^{\text{ref}}` the
  same sum, passed in or computed here from ``ref_x_*`` and ``ref_w``), :math:`\bar\pi = \pi / |y|`
  its mean over its :math:`|y|` unmasked tokens, :math:`\sigma` the logistic function. With
  :math:`h = (\pi_c - \pi^{\text{ref}}_c) - (\pi_r - \pi^{\text{ref}}_r)` and
  :math:`\ell_\varepsilon(u) = -(1 - \varepsilon) \log \sigma(u) - \varepsilon \log \sigma(-u)`
  (``label_smoothing`` :math:`\varepsilon`), the loss of a pair is

  - ``"dpo"`` (Rafailov et al. 2023; conservative DPO, Mitchell 2023, for
    :math:`\varepsilon > 0`): :math:`\ell_\varepsilon(\beta h)`;
  - ``"robust"`` (Chowdhury et al. 2024, robust DPO):
    :math:`\bigl(-(1 - \varepsilon) \log \sigma(\beta h) + \varepsilon \log \sigma(-\beta h)\bigr)
    / (1 - 2\varepsilon)`, :math:`\varepsilon < 1/2`;
  - ``"ipo"`` (Azar et al. 2024): :math:`(h - 1 / (2\beta))^2` with :math:`h` formed from the
    mean log-probabilities :math:`\bar\pi` (TRL's form; the paper writes sums);
  - ``"hinge"`` (SLiC-HF, Zhao et al. 2023, with the reference-normalised margin of RSO, Liu et
    al. 2024): :math:`\max(0, 1 - \beta h)`;
  - ``"simpo"`` (Meng et al. 2024, no reference):
    :math:`\ell_\varepsilon(\beta (\bar\pi_c - \bar\pi_r) - \gamma)` (``simpo_gamma``
    :math:`\gamma`);
  - ``"cpo"`` (Xu et al. 2024, no reference): :math:`\ell_\varepsilon(\beta (\pi_c - \pi_r))`, plus
    ``nll_weight`` times the chosen completions' negative log-likelihood;
  - ``"orpo"`` (Hong et al. 2024, no reference): :math:`-\beta \log \sigma(r)` with the log odds
    ratio :math:`r = \operatorname{odds}(\bar\pi_c) - \operatorname{odds}(\bar\pi_r)`,
    :math:`\operatorname{odds}(a) = a - \log(1 - e^a)` (``beta`` is the paper's :math:`\lambda`,
    as TRL names it), plus ``nll_weight`` times the chosen completions' negative log-likelihood;
  - ``"kto"`` (Ethayarajh et al. 2024; chosen completions are the desirable examples, rejected
    the undesirable, unpaired: the two batches may differ in size):
    :math:`\lambda_D\, \sigma(-\beta (\rho_c - z_0))` for each chosen and
    :math:`\lambda_U\, \sigma(-\beta (z_0 - \rho_r))` for each rejected completion, with
    :math:`\rho = \pi - \pi^{\text{ref}}` and the reference point
    :math:`z_0 = \max(0, \operatorname{mean}(\rho))` over the batch's completions, detached
    (``kto_kl`` gives it instead, e.g. from mismatched pairs as the paper estimates it).

  The loss is the mean over pairs (KTO: over completions); the negative log-likelihood of CPO
  and ORPO is the mean over the counted chosen completions' tokens (TRL's cross-entropy).

  **Empty sequences.** A sequence with no unmasked token has no log-probability: a pair with one
  (KTO: such a completion) does not count; it adds 0 to the loss, its tokens get zero gradients,
  and the mean is over the counted pairs (0 with zero gradients when none counts), so that a batch
  padded with empty pairs gives the unpadded batch's loss. Lengths :math:`|y|` are the counts of
  unmasked tokens.

  **Numerics.** Every loss is formed from ``jax.nn.log_sigmoid`` and ``jax.nn.sigmoid`` (no
  :math:`1 - \sigma`), ORPO's :math:`\log(1 - e^a)` from ``log(-expm1(a))`` or
  ``log1p(-exp(a))`` on either side of :math:`-\log 2`, with :math:`a` at most the float's
  smallest normal below 0 (a mean log-probability that rounds to 0 would make the odds infinite):
  finite values and gradients for margins of any finite size. Half precision inputs are computed
  in float32; the loss and metrics are float32 (float64 for float64 inputs).

  **What is kept.** The policy's log-probabilities are one :func:`jaxact.linear_log_probs` call
  over chosen and rejected tokens concatenated along the sequence axis (KTO's unpaired batches:
  one call each): its ``custom_vjp`` keeps ``x``, ``w``, ``bias``, the tokens and two float32
  numbers a token; no (tokens, vocabulary) array exists. The reference's are one more call on
  ``stop_gradient`` inputs: no residuals, no gradients. Under a mesh the batch axes keep their
  data-parallel sharding and the head its vocabulary split (:func:`jaxact.linear_log_probs`).

  Args:
    x_chosen: the policy's hidden states of the chosen completions, ``(..., T_c, D)``.
    x_rejected: of the rejected completions, ``(..., T_r, D)`` (the same batch shape as
      ``x_chosen`` but for ``"kto"``; the lengths may differ).
    w: the policy's head, ``(D, V)`` (``(V, D)`` for ``w_layout="vd"``).
    chosen_tokens: integer tokens ``(..., T_c)``: each position's next token.
    rejected_tokens: ``(..., T_r)``.
    chosen_mask: bool, broadcastable to ``chosen_tokens``: the completion's positions (prompt and
      padding False); None counts every position.
    rejected_mask: the same for the rejected completions.
    loss: ``"dpo"``, ``"ipo"``, ``"hinge"``, ``"robust"``, ``"simpo"``, ``"orpo"``, ``"cpo"`` or
      ``"kto"``.
    beta: :math:`\beta > 0` (ORPO's :math:`\lambda`).
    label_smoothing: :math:`\varepsilon \in [0, 1/2]` for ``"dpo"``, ``"simpo"`` and ``"cpo"``,
      :math:`[0, 1/2)` for ``"robust"``; the others take 0 only.
    simpo_gamma: SimPO's target margin :math:`\gamma \ge 0` (``"simpo"`` only).
    nll_weight: the weight :math:`\ge 0` of the chosen completions' negative log-likelihood
      (``"orpo"`` and ``"cpo"`` only; TRL's ``cpo_alpha``).
    desirable_weight: KTO's :math:`\lambda_D > 0` (``"kto"`` only).
    undesirable_weight: KTO's :math:`\lambda_U > 0` (``"kto"`` only).
    kto_kl: KTO's reference point :math:`z_0` (a scalar, used as given, detached); None
      estimates it from the batch as above (``"kto"`` only).
    ref_chosen_log_probs: the reference's sequence log-probabilities of the chosen completions
      (sums over the mask, of the batch shape), detached. With ``ref_rejected_log_probs``; or
      ``ref_x_*`` and ``ref_w`` instead; the reference-free losses (SimPO, CPO, ORPO) take none.
    ref_rejected_log_probs: of the rejected completions.
    ref_x_chosen: the reference's hidden states of the chosen completions (``(..., T_c, D_ref)``):
      its log-probabilities are computed here, detached, with the policy's temperature, cap and
      layout. With ``ref_x_rejected`` and ``ref_w``.
    ref_x_rejected: of the rejected completions.
    ref_w: the reference's head.
    ref_bias: the reference head's bias, or None.
    bias: the policy head's bias ``(V,)``, or None.
    temperature: :math:`T > 0`: the logits are divided by it (:func:`jaxact.linear_log_probs`).
    logit_soft_cap: :math:`c > 0` or None.
    w_layout: ``"dv"`` or ``"vd"``, of ``w`` and ``ref_w``.
    precision: of the matmuls.
    implementation: as :func:`jaxact.linear_log_probs` takes it.
    vocab_block_size: columns of ``w`` a block of the vocabulary loop; None chooses.

  Returns:
    ``(loss, metrics)``: the scalar loss and a dict of scalars, means over the counted pairs (KTO:
    completions), detached, under TRL's names: ``"rewards/chosen"``, ``"rewards/rejected"`` (the
    implicit rewards :math:`\beta(\pi - \pi^{\text{ref}})`; :math:`\beta \pi` for the
    reference-free losses; with :math:`\bar\pi` where the loss uses it), ``"rewards/margins"``,
    ``"rewards/accuracies"`` (the fraction of pairs whose chosen reward is the larger; not for
    KTO), ``"logps/chosen"``, ``"logps/rejected"`` (the policy's :math:`\pi`, or :math:`\bar\pi`);
    ORPO adds ``"log_odds_ratio"`` (the mean :math:`\log \sigma(r)`) and ``"log_odds_chosen"``
    (the mean :math:`r`), ORPO and CPO ``"nll_loss"``, KTO ``"kl"`` (:math:`z_0`).

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.ones((1, 2, 2))  # one pair of two-token completions, D = 2
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])  # V = 3
    >>> tokens = jnp.array([[0, 1]])
    >>> loss, metrics = jaxact.preference_loss(
    ...     x, -x, w, tokens, tokens, beta=0.5,
    ...     ref_chosen_log_probs=jnp.array([-2.0]), ref_rejected_log_probs=jnp.array([-2.0]))
    >>> round(float(loss), 4), round(float(metrics["rewards/margins"]), 4)
    (0.2049, 1.4809)
    >>> loss, metrics = jaxact.preference_loss(x, -x, w, tokens, tokens, loss="orpo")
    >>> round(float(metrics["log_odds_chosen"]), 4)
    2.0
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    if not isinstance(loss, str) or loss not in losses.LOSSES:
      raise ValueError(
        _err(f"`loss` {loss!r} is not known; choose one of: {', '.join(losses.LOSSES)}")
      )
    dispatch.check_implementation(_FN, implementation)
    checks.w_layout(_FN, w_layout)
    hyper = losses.hyperparameters(
      _FN,
      loss,
      beta=beta,
      label_smoothing=label_smoothing,
      simpo_gamma=simpo_gamma,
      nll_weight=nll_weight,
      desirable_weight=desirable_weight,
      undesirable_weight=undesirable_weight,
    )
    t_c = _tokens(chosen_tokens, "chosen_tokens")
    t_r = _tokens(rejected_tokens, "rejected_tokens")
    paired = loss != "kto"
    if paired and t_c.shape[:-1] != t_r.shape[:-1]:
      raise ValueError(
        _err(
          f"`chosen_tokens` and `rejected_tokens` must have the same batch shape (all but the "
          f"last axis) for loss={loss!r}; got {t_c.shape} and {t_r.shape}"
        )
      )
    arrays, acc, _ = args.prepare_arrays(
      _FN, {"x_chosen": x_chosen, "x_rejected": x_rejected, "w": w, "bias": bias}, None
    )
    x_c, x_r, w, b = (arrays[k] for k in ("x_chosen", "x_rejected", "w", "bias"))
    features = _features(w, w_layout, "w")
    _hidden(x_c, t_c, "x_chosen", "chosen_tokens", features)
    _hidden(x_r, t_r, "x_rejected", "rejected_tokens", features)
    vocab = w.shape[1] if w_layout == "dv" else w.shape[0]
    if b is not None and b.shape != (vocab,):
      raise ValueError(_err(f"`bias` has shape {b.shape}; accepted: ({vocab},) or None"))
    m_c = _mask(chosen_mask, t_c.shape, "chosen_mask", "chosen_tokens")
    m_r = _mask(rejected_mask, t_r.shape, "rejected_mask", "rejected_tokens")
    checks.check_label_range(_FN, t_c, m_c, None, vocab, "chosen_tokens", mask="chosen_mask")
    checks.check_label_range(_FN, t_r, m_r, None, vocab, "rejected_tokens", mask="rejected_mask")
    acc = np.dtype(acc)
    temperature = checks.number(_FN, "temperature", temperature, low=0.0, low_open=True)
    if logit_soft_cap is not None:
      checks.number(_FN, "logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
    options = dict(
      temperature=temperature,
      logit_soft_cap=logit_soft_cap,
      return_entropy=False,
      w_layout=w_layout,
      precision=precision,
      implementation=implementation,
      vocab_block_size=vocab_block_size,
    )
    ref = _reference(
      loss,
      (t_c, t_r, m_c, m_r, vocab, acc),
      (ref_chosen_log_probs, ref_rejected_log_probs),
      (ref_x_chosen, ref_x_rejected, ref_w, ref_bias),
      options,
    )
    kl = None if kto_kl is None else _kto_kl(loss, kto_kl, acc)
    if math.prod(t_c.shape) + math.prod(t_r.shape) == 0:
      lp_c, lp_r = jnp.zeros(t_c.shape, acc), jnp.zeros(t_r.shape, acc)
    else:
      lp_c, lp_r = _per_token(x_c, x_r, w, b, t_c, t_r, m_c, m_r, options)
    return losses.compute(loss, hyper, lp_c, lp_r, m_c, m_r, ref, kl)


def _kto_kl(loss: str, kto_kl, acc) -> Array:
  if loss != "kto":
    raise ValueError(_err(f"`kto_kl` is KTO's reference point; loss={loss!r} takes None"))
  kl = validation.as_real_array(_FN, kto_kl, "kto_kl")
  if kl.shape != () or not validation.is_floating(kl.dtype):
    raise ValueError(
      _err(f"`kto_kl` must be a floating-point scalar; got shape {kl.shape}, dtype {kl.dtype}")
    )
  return lax.stop_gradient(kl.astype(acc))


def _reference(loss, batch, given, inputs, options) -> tuple[Array, Array] | None:
  """The reference's sequence log-probabilities (chosen, rejected), detached: passed in
  (`given`), computed from its hidden states and head (`inputs`), or None for the reference-free
  losses; an error where the loss and what is passed disagree."""
  t_c, t_r, m_c, m_r, vocab, acc = batch
  names = ("ref_chosen_log_probs", "ref_rejected_log_probs")
  in_names = ("ref_x_chosen", "ref_x_rejected", "ref_w", "ref_bias")
  passed = [n for n, a in zip(names + in_names, given + inputs, strict=True) if a is not None]
  if loss not in losses.REFERENCED:
    if passed:
      raise ValueError(
        _err(f"loss={loss!r} is reference-free; it takes no {', '.join(f'`{n}`' for n in passed)}")
      )
    return None
  if any(a is not None for a in given):
    if any(a is not None for a in inputs):
      raise ValueError(
        _err(
          "pass the reference's log-probabilities (`ref_chosen_log_probs`, "
          "`ref_rejected_log_probs`) or its inputs (`ref_x_chosen`, `ref_x_rejected`, `ref_w`), "
          f"not both; got {', '.join(f'`{n}`' for n in passed)}"
        )
      )
    out = []
    for name, a, t in zip(names, given, (t_c, t_r), strict=True):
      if a is None:
        raise ValueError(_err(f"`{name}` is missing: loss={loss!r} needs both reference sums"))
      a = validation.as_real_array(_FN, a, name)
      if not validation.is_floating(a.dtype) or a.shape != t.shape[:-1]:
        raise ValueError(
          _err(
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
        _err(
          f"loss={loss!r} needs the reference: pass `ref_chosen_log_probs` and "
          "`ref_rejected_log_probs`, or `ref_x_chosen`, `ref_x_rejected` and `ref_w`"
          + ("" if not passed else f" (`{name}` is missing)")
        )
      )
  arrays, _, _ = args.prepare_arrays(
    _FN, {"ref_x_chosen": x_c, "ref_x_rejected": x_r, "ref_w": w, "ref_bias": b}, None
  )
  x_c, x_r, w, b = (lax.stop_gradient(a) if a is not None else None for a in arrays.values())
  features = _features(w, options["w_layout"], "ref_w")
  _hidden(x_c, t_c, "ref_x_chosen", "chosen_tokens", features)
  _hidden(x_r, t_r, "ref_x_rejected", "rejected_tokens", features)
  ref_vocab = w.shape[1] if options["w_layout"] == "dv" else w.shape[0]
  if ref_vocab != vocab or (b is not None and b.shape != (vocab,)):
    raise ValueError(
      _err(
        f"the reference's head must have the policy's vocabulary ({vocab}); got ref_w.shape="
        f"{w.shape}" + ("" if b is None else f", ref_bias.shape={b.shape}")
      )
    )
  if t_c.size + t_r.size == 0:
    return jnp.zeros(t_c.shape[:-1], acc), jnp.zeros(t_r.shape[:-1], acc)
  lp_c, lp_r = _per_token(x_c, x_r, w, b, t_c, t_r, m_c, m_r, options)
  return lax.stop_gradient(lp_c.sum(-1).astype(acc)), lax.stop_gradient(lp_r.sum(-1).astype(acc))
