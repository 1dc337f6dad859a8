"""RMS and layer norms that keep their output: :func:`jaxact.rms_norm`, :func:`jaxact.layer_norm`,
and the Flax ``RMSNorm`` / ``LayerNorm`` layers.

``api`` checks the arguments and builds the plan (``plan``), ``vjp`` is the ``custom_vjp`` (XLA
only: the norms have no kernels and no decision rules), ``reference`` the plain formulas the tests
compare against, and ``linen`` / ``nnx`` the Flax layers.
"""
