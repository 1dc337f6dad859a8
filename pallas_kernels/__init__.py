"""Pallas GPU kernels for jaxact's fused layers.

This package is importable on its own (it depends only on jax). The fused dense/conv kernels arrive
with the Pallas issue; until then it exports nothing and jaxact uses XLA everywhere.
"""

__all__: list[str] = []
