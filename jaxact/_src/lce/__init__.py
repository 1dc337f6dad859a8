"""The LM head and its losses, without the logits: :func:`jaxact.linear_cross_entropy`, the
per-token log-probabilities and entropy :func:`jaxact.linear_log_probs`, the post-training losses
on them (:func:`jaxact.policy_gradient_loss`, :func:`jaxact.preference_loss`), distillation
between two heads (:func:`jaxact.distillation_loss`), and the Flax ``LMHead`` layers and
``attend_cross_entropy``.

``api`` checks the arguments and builds the plan (``plan``); ``api_log_probs``, ``api_policy``,
``api_preference`` (``api_preference_inputs`` its inputs, ``api_preference_losses`` its arithmetic
on sequence log-probabilities) and ``api_distill`` do the same for the other ops, ``api_checks``
holds the checks they share. ``rules`` decides the backend (the one decision point's LM-head rows),
``vjp`` is the ``custom_vjp``, ``xla`` its vocabulary-blocked XLA path (``xla_tiles`` the math of
one block and of each token's statistics), ``sharding`` the per-device runs under Explicit mesh
axes, ``kernels`` the calls of the Hopper kernels; ``vjp_distill``, ``xla_distill`` and
``sharding_distill`` are the same three for two heads at once. ``reference`` holds the plain
formulas the tests compare against, ``linen`` / ``nnx`` the Flax layers.
"""
