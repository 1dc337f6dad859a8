"""The mesh layouts of the MoE expert-parallel tests (tests/moe/test_moe_sharding.py, and the
kernels' check under expert parallelism in tests/moe/test_moe_triton.py): 8 devices, experts over
an ``expert`` axis with data, tensor and FSDP axes beside."""

from jax.sharding import PartitionSpec as P

# name: (mesh shape, axis names, specs of x, router, w_gate, w_up, w_down, options)
CASES = {
  "ep": ((8,), ("expert",), (P("expert"), P(), P("expert"), P("expert"), P("expert")), {}),
  "ep_data": (
    (2, 4),
    ("data", "expert"),
    (P(("data", "expert")), P(), P("expert"), P("expert"), P("expert")),
    {},
  ),
  "ep_data_tensor": (
    (2, 2, 2),
    ("data", "expert", "model"),
    (
      P(("data", "expert")),
      P(),
      P("expert", None, "model"),
      P("expert", None, "model"),
      P("expert", "model"),
    ),
    {},
  ),
  "ep_fsdp": (
    (2, 4),
    ("data", "expert"),
    (
      P(("data", "expert")),
      P(),
      P("expert", "data"),
      P("expert", "data"),
      P("expert", None, "data"),
    ),
    {},
  ),
  "data": ((8,), ("data",), (P("data"), P(), P(), P(), P()), {}),  # no expert axis: no all-to-all
  "ep_skewed": (  # every token's two experts are 0 and 1, on one device: the dropless extreme
    (8,),
    ("expert",),
    (P("expert"), P(), P("expert"), P("expert"), P("expert")),
    {"router_bias": True},
  ),
  "ep_deepseek_v3": (  # the group limit and the sequence-wise balance loss, B sequences of S
    (2, 4),
    ("data", "expert"),
    (P(("data", "expert")), P(), P("expert"), P("expert"), P("expert")),
    {"score": "sigmoid", "expert_groups": 4, "top_k_groups": 2, "balance_loss": "deepseek_v3"},
  ),
  "ep_data_capacity": (
    (2, 4),
    ("data", "expert"),
    (P(("data", "expert")), P(), P("expert"), P("expert"), P("expert")),
    {"capacity_factor": 1.0, "score": "sigmoid"},
  ),
}
