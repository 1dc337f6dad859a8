"""What every op family shares, below all of them: nothing here imports a family.

``spec`` is the activation spec table; ``validation`` and ``args`` check arguments; ``barriers``
and ``dropout`` are the residual barriers and the in-op dropout; ``dispatch`` is the decision
machinery (the target GPU or TPU, ``Decision``, ``Rule``; each family's rules live in its
``rules.py``); ``platform`` switches between kernels and XLA by the lowering platform (CUDA or
TPU); ``shardings`` reads the shardings in the arrays' types, and ``pallas_sharding`` runs
kernels per shard.
"""
