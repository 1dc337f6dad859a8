"""docs/porting-flax.md's attention recipe, run as the page writes it, against the Flax Gemma
example's own attention (``example_attention`` of ``support.flax_gemma``, written
after its ``Attention.__call__``): the query pre-scaled by a ``query_pre_attn_scalar`` that is not
``head_dim**-0.5``, the logits capped, and masks that are not causal. A recipe that drops
``scale=``, hard-codes ``is_causal`` or a one-sided window, or ignores the mask it is given fails.
"""

import pathlib
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.flax_gemma import example_attention, make_causal_attn_mask

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "porting-flax.md"
B, T, N, K, H, W = 2, 8, 4, 2, 8, 3
SCALAR = 12**-0.5  # (embed_dim // num_heads)**-0.5 with 12 of them a head: not H**-0.5
CAP = 5.0


@pytest.fixture(scope="module")
def recipe() -> dict:
  """The page's blocks from the one that defines `attend` to the one that defines
  `attend_causal`, run in one namespace as test_docs runs the page's."""
  blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
  first = next(i for i, block in enumerate(blocks) if "def attend(" in block)
  last = next(i for i, block in enumerate(blocks) if "def attend_causal(" in block)
  namespace = {"__name__": "porting_guide_recipe"}
  for i, block in list(enumerate(blocks))[first : last + 1]:
    exec(compile(block, f"{PAGE.name} (python block {i + 1})", "exec"), namespace)
  return namespace


def module(recipe, local: bool, dropout=None):
  """An example Attention's attributes, as its Block sets them."""
  kind = recipe["AttentionType"]
  return SimpleNamespace(
    attn_type=kind.LOCAL_SLIDING if local else kind.GLOBAL,
    sliding_window_size=W,
    query_pre_attn_scalar=SCALAR,
    attn_logits_soft_cap=CAP,
    dropout=dropout or nnx.Dropout(0.0),
    shd_config=SimpleNamespace(act_btnh=None),
  )


def inputs():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = 3 * jax.random.normal(kq, (B, T, N, H), jnp.float32)  # logits large enough to be capped
  k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
  v = jax.random.normal(kv, (B, T, K, H), jnp.float32)
  return q, k, v


LENGTHS = jnp.array([[T], [T - 2]])
PADDING = jnp.arange(T)[None, :] < LENGTHS  # the second row's last two tokens are padding
MASKS = {
  # Flax's transformer_test.test_load_from_params: every key, one row for every query
  "load_from_params": jnp.ones((B, 1, T), bool),
  # bidirectional over the tokens that are not padding (a prefix-LM's prefix, an encoder)
  "padding_only": jnp.broadcast_to(PADDING[:, None, :], (B, T, T)),
  # train.py's and eval_step's
  "causal": make_causal_attn_mask(PADDING),
}
CASES = [
  ("load_from_params", False),
  ("load_from_params", True),  # the example's band of a one-row mask
  ("padding_only", True),  # the symmetric window, both halves
  ("causal", True),
]


def values_and_grads(f, q, k, v):
  cotangent = jax.random.normal(jax.random.key(1), (B, T, N, H), jnp.float32)
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * cotangent), (0, 1, 2)))(q, k, v)


def example(attn, mask):
  local = attn.attn_type.name == "LOCAL_SLIDING"
  return lambda q, k, v: example_attention(
    q,
    k,
    v,
    mask,
    query_pre_attn_scalar=attn.query_pre_attn_scalar,
    attn_logits_soft_cap=attn.attn_logits_soft_cap,
    sliding_window_size=attn.sliding_window_size if local else None,
  )


@pytest.mark.parametrize(
  "name, local", CASES, ids=[f"{m}-{'local' if w else 'global'}" for m, w in CASES]
)
def test_the_guides_attention_is_the_examples(recipe, name, local):
  attn, mask = module(recipe, local), MASKS[name]
  q, k, v = inputs()
  want, want_grads = values_and_grads(example(attn, mask), q, k, v)
  got, got_grads = values_and_grads(lambda q, k, v: recipe["attend"](attn, q, k, v, mask), q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_guides_causal_form_is_the_examples_under_train_pys_mask(recipe):
  """`attend_causal` with train.py's padding and packed segments, against the example under
  make_causal_attn_mask and the segment mask train.py adds."""
  attn = module(recipe, local=True)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]])
  mask = make_causal_attn_mask(PADDING) & (segments[:, :, None] == segments[:, None, :])
  q, k, v = inputs()
  want = values_and_grads(example(attn, mask), q, k, v)
  got = values_and_grads(
    lambda q, k, v: recipe["attend_causal"](attn, q, k, v, PADDING, segments), q, k, v
  )
  # Every query sees a key here (itself, or for padding the real tokens before it).
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_guides_attention_drops_out_as_the_examples_module_says(recipe):
  """Dropout is off in the deterministic view (train.py's eval model), on otherwise."""
  q, k, v = inputs()
  mask = MASKS["causal"]
  off = module(recipe, True, nnx.Dropout(0.5, deterministic=True))
  on = module(recipe, True, nnx.Dropout(0.5))

  @jax.jit
  def run(q, k, v, mask):
    plain = recipe["attend"](module(recipe, True), q, k, v, mask)
    dropped = recipe["attend"](on, q, k, v, mask, rngs=nnx.Rngs(dropout=0))
    return plain, recipe["attend"](off, q, k, v, mask), dropped

  plain, deterministic, dropped = run(q, k, v, mask)
  np.testing.assert_array_equal(deterministic, plain)
  assert not np.allclose(dropped, plain)
