"""RMS and layer norms that keep their output: :func:`jaxact.rms_norm`, :func:`jaxact.layer_norm`,
and the Flax ``RMSNorm`` / ``LayerNorm`` layers.

``api`` holds the public functions and their ``custom_vjp`` (XLA only: the norms have no kernels
and no decision rules), and ``linen`` / ``nnx`` the Flax layers.
"""
