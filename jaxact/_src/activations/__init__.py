"""The activations, generated from the spec table: :func:`jaxact.relu`, :func:`jaxact.gelu`, ...

``api`` holds the elementwise ``custom_vjp`` rule and the public functions made from each spec row,
``softmax`` the rules of glu, softmax and log_softmax, and ``resolve`` what the fused ops make of
their ``activation`` argument (the static ``Act`` of a plan, the kernels' epilogue of a spec row).
"""
