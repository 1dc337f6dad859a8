"""Batch and group norms fused with their activation, keeping one array for the backward pass:
:func:`jaxact.batch_norm_act`, :func:`jaxact.group_norm_act`, and the Flax ``BatchNorm`` /
``GroupNorm`` layers with an ``activation``.

``api`` checks the arguments and builds the plan (``plan``), ``rules`` decides the backend
(``implementation=``), ``vjp`` is the ``custom_vjp`` (XLA's, or the Triton kernels' calls in
``kernels``), ``reference`` the plain formulas the tests compare against, and ``linen`` / ``nnx``
the Flax layers.
"""
