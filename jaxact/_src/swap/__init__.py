"""One line for a Flax model: Flax's own modules and jax.nn's activations routed to jaxact's ops.

``linen.py``: :func:`jaxact.linen.intercept`, a context (and decorator) under which calls of
Flax's linen modules and of jax.nn / Flax activation functions run jaxact's ops with the modules'
own variables. ``nnx.py``: :func:`jaxact.nnx.swap`, which turns a model's nnx module instances into
jaxact's in place (the same Variables). ``activations.py``: the activation functions' routing and
the fusion of a layer with the activation its output goes straight into. ``report.py``: what was
taken and what was left, and why. Above the op families: it imports them, none imports it.
"""
