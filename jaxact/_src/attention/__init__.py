"""Attention that keeps its output: :func:`jaxact.dot_product_attention`.

``api`` is the public function; ``api_checks`` checks its arguments into one call (``plan``: the
static plan and the arrays it runs on), ``rules`` decides the backend (the one decision point's
attention rows), ``vjp`` is the ``custom_vjp`` every backend shares, ``xla`` the blocked XLA path,
``kernels`` the calls of the Pallas kernels, ``sharding`` the per-device runs under Explicit mesh
axes, ``linen`` and ``nnx`` Flax's ``attention_fn`` signatures (what they share in ``api_flax``),
and ``reference`` the plain formula the tests compare against.
"""
