"""The LM head and its loss as one op, without the logits: :func:`jaxact.linear_cross_entropy`,
and the Flax ``LMHead`` layers and ``attend_cross_entropy``.

``api`` checks the arguments and builds the plan (``plan``), ``rules`` decides the backend (the
one decision point's LM-head rows), ``vjp`` is the ``custom_vjp``, ``xla`` its vocabulary-blocked
XLA path, ``sharding`` the per-device runs under Explicit mesh axes, ``kernels`` the calls of the
Hopper kernels, and ``linen`` / ``nnx`` the Flax layers.
"""
