"""Attention that keeps its output: :func:`jaxact.dot_product_attention`.

``api`` checks the arguments and builds the plan, ``rules`` decides the backend (the one decision
point's attention rows), ``xla`` holds the ``custom_vjp`` and its blocked XLA path, ``kernels``
calls the Pallas kernels, ``flax_fn`` gives Flax's ``attention_fn`` signature, and ``reference``
is the plain formula the tests compare against.
"""
