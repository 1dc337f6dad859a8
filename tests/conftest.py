"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import jax

jax.config.update("jax_enable_x64", True)
