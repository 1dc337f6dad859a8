"""Fused ``activation(x @ w + b)`` and ``activation(conv(x, w) + b)`` that keep only the output:
:func:`jaxact.dense_bias_act`, :func:`jaxact.conv_bias_act`, and their Flax layers.

``api`` checks the arguments and builds the plan (``plan``), ``rules`` decides the backend (the
one decision point's fused rows), ``vjp`` is the ``custom_vjp`` with its XLA path, ``kernels`` the
calls of the Pallas kernels, and ``linen`` / ``nnx`` the Flax layers (``DenseAct``, ``ConvAct``,
``LinearAct``) with what they share in ``layers``.
"""
