"""Few-bit derivative codes: what an input-residual activation keeps instead of its input.

``code`` is the code itself (packing, the stored table's lookup, ``residual_bits`` checked),
``derive`` how the stored codes are derived (``python -m jaxact._src.codes.derive`` writes
``table.py``, the generated table).
"""
