"""Gated linear units and the gated MLP of transformers, keeping two hidden-sized arrays a layer:
:func:`jaxact.gated_dense`, :func:`jaxact.gated_mlp`, and the Flax ``GatedMLP`` layers.

``api`` checks the arguments and builds the plan (``plan``), ``rules`` decides the backend (the
one decision point's gated rows), ``vjp`` is the ``custom_vjp`` with its XLA path, ``kernels`` the
calls of the Pallas kernels, and ``linen`` / ``nnx`` the Flax layers.
"""
