"""The LM head and its loss as one op, without the logits: :func:`jaxact.linear_cross_entropy`,
the per-token log-probabilities and entropy :func:`jaxact.linear_log_probs`, the preference
losses on them :func:`jaxact.preference_loss`, and the Flax ``LMHead`` layers and
``attend_cross_entropy``.

``api`` checks the arguments and builds the plan (``plan``), ``api_log_probs`` does the same for the
log-probabilities, ``api_preference`` for the preference losses (``api_preference_losses`` their
arithmetic on sequence log-probabilities), ``api_checks`` holds the checks they share, ``rules``
decides the backend (the one decision point's LM-head rows), ``vjp`` is the ``custom_vjp``, ``xla``
its vocabulary-blocked XLA path (``xla_tiles`` the math of one block and of each token's
statistics), ``sharding`` the per-device runs under Explicit mesh axes, ``kernels`` the calls of the
Hopper kernels, ``reference`` the plain formulas the tests compare against, and ``linen`` / ``nnx``
the Flax layers.
"""
