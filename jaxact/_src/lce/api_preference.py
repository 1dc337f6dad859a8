"""The preference losses of post-training from the hidden states and the LM head, without the
logits: :func:`preference_loss` (DPO and the other losses of TRL's DPOTrainer, SimPO, ORPO, CPO,
KTO).

Every loss is a function of each completion's sequence log-probability, the sum (or, for IPO,
sigmoid_norm, SimPO and ORPO, the mean) of its tokens' :func:`jaxact.linear_log_probs` over the
completion's mask. Chosen and rejected completions (and the reference's, when computed in the call)
go through one :func:`~jaxact._src.lce.api_log_probs.linear_log_probs` call each, their tokens
concatenated along the sequence axis (the batch's data-parallel sharding kept), so one vocabulary
loop a pass serves both (:mod:`jaxact._src.lce.api_preference_inputs`, with the checks of the
inputs); the losses' own arithmetic is on (batch,) numbers and lives in
:mod:`jaxact._src.lce.api_preference_losses`.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import args, dispatch
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import api_preference_inputs as inputs
from jaxact._src.lce import api_preference_losses as losses

_FN = "preference_loss"
Loss = Literal[
  "dpo", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
  "apo_down", "discopop", "sigmoid_norm", "simpo", "orpo", "cpo", "kto",
]  # fmt: skip


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
  discopop_tau: float = 0.05,
  nll_weight: float = 1.0,
  nll_mask: ArrayLike | None = None,
  rpo_alpha: float | None = None,
  ld_alpha: float | None = None,
  f_divergence_type: str = "reverse_kl",
  f_alpha_divergence_coef: float = 1.0,
  bco_reward_mean: ArrayLike | None = None,
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
  - TRL's DPOTrainer losses of the same names, with :math:`u = \beta h` and the rewards
    :math:`r = \beta (\pi - \pi^{\text{ref}})`: ``"exo_pair"`` (EXO, Ji et al. 2024, eq. 16)
    :math:`\sigma(u) (\log\sigma(u) - \log(1 - \varepsilon)) + \sigma(-u) (\log\sigma(-u) -
    \log\varepsilon)`, :math:`\varepsilon \in (0, 1/2]`; ``"nca_pair"`` (NCA, Chen et al. 2024)
    :math:`-\log\sigma(r_c) - \tfrac12 \log\sigma(-r_c) - \tfrac12 \log\sigma(-r_r)`;
    ``"bco_pair"`` (BCO, Jung et al. 2024) :math:`-\log\sigma(r_c - \delta) - \log\sigma(\delta -
    r_r)` (``bco_reward_mean`` :math:`\delta`, 0 by default); ``"sppo_hard"`` (SPPO, Wu et al.
    2024) :math:`(\rho_c - \tfrac{1}{2\beta})^2 + (\rho_r + \tfrac{1}{2\beta})^2`,
    :math:`\rho = \pi - \pi^{\text{ref}}`; ``"apo_zero"`` and ``"apo_down"`` (APO, D'Oosterlinck
    et al. 2024, eqs. 7, 8) :math:`\sigma(-r_c) + \sigma(r_r)` and :math:`\sigma(r_c) +
    \sigma(-u)`; ``"discopop"`` (Lu et al. 2024, eq. 5) :math:`\sigma(-u/\tau)
    (-\log\sigma(u)) + \sigma(u/\tau) e^{-u}` (``discopop_tau`` :math:`\tau`);
    ``"sigmoid_norm"`` :math:`-\log\sigma(\beta h)` with :math:`h` from the means, as IPO;
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

  The loss is the mean over pairs (KTO: over completions). The chosen completions' negative
  log-likelihood (CPO's and ORPO's, weighted by ``nll_weight``; any other paired loss's with
  ``rpo_alpha``) is the mean over the counted chosen completions' tokens (TRL's and Liger's
  cross-entropy), from the same log-probabilities. With ``ld_alpha`` (LD-DPO, Liu et al. 2024;
  TRL's DPOTrainer losses) each sequence sum weights the tokens past the pair's shared length
  :math:`\min(|y_c|, |y_r|)` by :math:`\alpha`, the policy's and a reference computed here alike
  (reference sums passed in must be weighted so already).

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
    loss: one of the losses above.
    beta: :math:`\beta > 0` (ORPO's :math:`\lambda`).
    label_smoothing: :math:`\varepsilon \in [0, 1/2]` for ``"dpo"``, ``"simpo"`` and ``"cpo"``,
      :math:`[0, 1/2)` for ``"robust"``, :math:`(0, 1/2]` for ``"exo_pair"``; the others take 0.
    simpo_gamma: SimPO's target margin :math:`\gamma \ge 0` (``"simpo"`` only).
    discopop_tau: DiscoPOP's :math:`\tau > 0` (``"discopop"`` only).
    nll_weight: the weight :math:`\ge 0` of the chosen completions' negative log-likelihood
      (``"orpo"`` and ``"cpo"`` only; TRL's ``cpo_alpha``).
    nll_mask: bool, broadcastable to ``chosen_tokens``: the chosen positions the NLL counts
      (ORPO's, CPO's, ``rpo_alpha``'s); None: ``chosen_mask``'s. TRL's ORPOTrainer counts the
      prompt too: pass the prompt's and the completion's positions (its attention mask).
    rpo_alpha: the weight :math:`\ge 0` of the chosen completions' negative log-likelihood added
      to any paired loss but ORPO and CPO (TRL's ``rpo_alpha``, Liger's ``alpha`` with
      ``compute_nll_loss``); None adds none.
    ld_alpha: LD-DPO's :math:`\alpha \in [0, 1]` (TRL's DPOTrainer losses); None weights every
      token 1.
    f_divergence_type: TRL's f-DPO (Wang et al. 2023) for ``"dpo"``, ``"robust"``, ``"ipo"``,
      ``"hinge"`` and ``"exo_pair"``: ``"reverse_kl"`` (DPO's margin :math:`h`), or
      ``"js_divergence"`` (:math:`h - (\operatorname{softplus}(\rho_c) -
      \operatorname{softplus}(\rho_r))`) or ``"alpha_divergence"`` (:math:`(e^{-a \rho_r} -
      e^{-a \rho_c}) / a`, each exponent capped at a quarter of the float's log range, where TRL
      caps it at the whole range and float32 overflows) in its place,
      :math:`\rho = \pi - \pi^{\text{ref}}`.
    f_alpha_divergence_coef: :math:`a > 0` of ``"alpha_divergence"`` (TRL's
      ``f_alpha_divergence_coef``).
    bco_reward_mean: BCO's reward shift :math:`\delta` (a scalar, detached; TRL's running mean of
      the rewards); None is 0 (``"bco_pair"`` only).
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
    (the mean :math:`r`), ORPO, CPO and ``rpo_alpha`` ``"nll_loss"``, KTO ``"kl"`` (:math:`z_0`).

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
        inputs.err(f"`loss` {loss!r} is not known; choose one of: {', '.join(losses.LOSSES)}")
      )
    dispatch.check_implementation(_FN, implementation)
    checks.w_layout(_FN, w_layout)
    hyper = losses.hyperparameters(
      _FN,
      loss,
      beta=beta,
      label_smoothing=label_smoothing,
      simpo_gamma=simpo_gamma,
      discopop_tau=discopop_tau,
      nll_weight=nll_weight,
      rpo_alpha=rpo_alpha,
      ld_alpha=ld_alpha,
      f_divergence_type=f_divergence_type,
      f_alpha_divergence_coef=f_alpha_divergence_coef,
      desirable_weight=desirable_weight,
      undesirable_weight=undesirable_weight,
    )
    t_c = inputs.tokens(chosen_tokens, "chosen_tokens")
    t_r = inputs.tokens(rejected_tokens, "rejected_tokens")
    paired = loss != "kto"
    if paired and t_c.shape[:-1] != t_r.shape[:-1]:
      raise ValueError(
        inputs.err(
          f"`chosen_tokens` and `rejected_tokens` must have the same batch shape (all but the "
          f"last axis) for loss={loss!r}; got {t_c.shape} and {t_r.shape}"
        )
      )
    arrays, acc, _ = args.prepare_arrays(
      _FN, {"x_chosen": x_chosen, "x_rejected": x_rejected, "w": w, "bias": bias}, None
    )
    x_c, x_r, w, b = (arrays[k] for k in ("x_chosen", "x_rejected", "w", "bias"))
    features = inputs.features(w, w_layout, "w")
    inputs.hidden(x_c, t_c, "x_chosen", "chosen_tokens", features)
    inputs.hidden(x_r, t_r, "x_rejected", "rejected_tokens", features)
    vocab = w.shape[1] if w_layout == "dv" else w.shape[0]
    if b is not None and b.shape != (vocab,):
      raise ValueError(inputs.err(f"`bias` has shape {b.shape}; accepted: ({vocab},) or None"))
    m_c = inputs.mask(chosen_mask, t_c.shape, "chosen_mask", "chosen_tokens")
    m_r = inputs.mask(rejected_mask, t_r.shape, "rejected_mask", "rejected_tokens")
    m_nll = None
    if nll_mask is not None:
      if loss not in losses.NLL and hyper["rpo_alpha"] is None:
        raise ValueError(
          inputs.err(
            f"`nll_mask` is given, but loss={loss!r} without `rpo_alpha` has no NLL term (ORPO's "
            "and CPO's have one; any other paired loss with `rpo_alpha`)"
          )
        )
      m_nll = inputs.mask(nll_mask, t_c.shape, "nll_mask", "chosen_tokens")
      checks.check_label_range(_FN, t_c, m_nll, None, vocab, "chosen_tokens", mask="nll_mask")
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
    weights = losses.ld_weights(m_c, m_r, hyper["ld_alpha"], acc)
    ref = inputs.reference(
      loss,
      (t_c, t_r, m_c, m_r, vocab, acc),
      (ref_chosen_log_probs, ref_rejected_log_probs),
      (ref_x_chosen, ref_x_rejected, ref_w, ref_bias),
      options,
      weights,
    )
    kl = inputs.given(loss, "kto_kl", kto_kl, acc)
    shift = inputs.given(loss, "bco_reward_mean", bco_reward_mean, acc)
    if math.prod(t_c.shape) + math.prod(t_r.shape) == 0:
      lp_c, lp_r = jnp.zeros(t_c.shape, acc), jnp.zeros(t_r.shape, acc)
    else:
      # where the NLL counts positions the completion does not (a prompt), their log-probs too;
      # the sequence sums weigh only the completion's (`weights`)
      counted_c = m_c if m_nll is None else m_c | m_nll
      lp_c, lp_r = inputs.per_token(x_c, x_r, w, b, t_c, t_r, counted_c, m_r, options)
    given = kl if loss == "kto" else shift
    return losses.compute(loss, hyper, lp_c, lp_r, m_c, m_r, weights, ref, given, m_nll)
