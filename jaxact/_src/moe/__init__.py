"""Mixture-of-experts MLPs keeping two hidden-sized arrays a routed token: :func:`jaxact.moe_mlp`
and the Flax ``MoEMLP`` layers.

``api`` checks the arguments and builds the plan (``plan``), ``api_routing`` routes the tokens
(router scores, top-k, the sort by expert, the auxiliary losses), ``vjp`` is the ``custom_vjp`` of
the experts' gated MLPs, ``reference`` the dense per-expert loop the tests compare against,
``api_transformers`` reads transformers' MoE block parameters, and ``linen`` / ``nnx`` are the
Flax layers.
"""
