"""What the Flax layers of every family share (``common``: activation and feature checks, dropout,
Flax's padding and batch flattening; ``nnx``: the dropout key of an nnx call), below the families
that define layers (``fused``, ``gated``, ``norms``, ``lce``) so that none imports another."""
