"""docs/porting-flax.md taken at its word: its blocks titled with one of the example's files
(``layers.py``, ``modules.py``, ``transformer.py``, ``train.py``; ``models.py``) are pasted, as the
page says, into a fresh copy of Flax's example (tests/gemma_example.py, tests/resnet_example.py,
written after Flax's files), and the port is compared with the example:

* Gemma: the same parameters from the same seed; the logits under train.py's causal, padded and
  packed masks (as the array and as the page's ``CausalMask``), Flax's all-ones ``(B, 1, S)`` and
  a padded bidirectional one, and with the sampler's cache; train.py's whole step under
  ``jax.jit`` with block remat; the attention alone, with gradients, against
  ``support.flax_gemma.example_attention``;
* ResNet: the page's ``to_conv_norm_act`` on a whole model's variables is exactly the ported
  model's tree, and the two models agree in float64 (train and eval, one ``train.py`` step under
  ``pmap``); the units keep the example's dtype;
* the H100 recipe runs as written beside the target config jax's CUDA plugin carries.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import support
from support.flax_gemma import example_attention, make_causal_attn_mask

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "porting-flax.md").read_text()
TITLED = re.findall(r'^```python title="([\w.]+)"\n(.*?)^```', PAGE, re.S | re.M)
PLAIN = re.findall(r"^```python\n(.*?)^```", PAGE, re.S | re.M)


def _fresh_copy(example: str, name: str, monkeypatch, files: tuple[str, ...] = ()):
  """A fresh copy of tests/`example`.py as module `name`, standing in (in sys.modules) for each
  of the example's `files` (so that a block's ``import modules`` finds it)."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{example}.py")
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, name, module)
  spec.loader.exec_module(module)
  for file in files:
    monkeypatch.setitem(sys.modules, file.removesuffix(".py"), module)
  return module


def _paste(module, files: tuple[str, ...]) -> None:
  """The page's blocks titled with one of `files`, in the page's order, executed in `module`
  as the same blocks pasted at the end of those files of the example."""
  pasted = [(title, code) for title, code in TITLED if title in files]
  assert {title for title, _ in pasted} == set(files), "the page lost a file's block"
  for i, (title, code) in enumerate(pasted):
    code = compile(code, f"porting-flax.md ({title}, block {i + 1})", "exec", dont_inherit=True)
    exec(code, module.__dict__)


# ------------------------------------------------------------------------------------- Gemma

GEMMA_FILES = ("layers.py", "modules.py", "transformer.py", "train.py")
B, T = 2, 8


@pytest.fixture(scope="module")
def gemma():
  with pytest.MonkeyPatch.context() as mp:
    example = _fresh_copy("gemma_example", "gemma_example_original", mp)
    port = _fresh_copy("gemma_example", "gemma_example_port", mp, GEMMA_FILES)
    # transformer_cfg's layer kinds, taken before any block is pasted: a block that defined its
    # own AttentionType would not change what the configs hold
    kinds = {m: (m.AttentionType.LOCAL_SLIDING, m.AttentionType.GLOBAL) for m in (example, port)}
    _paste(port, GEMMA_FILES)
    yield SimpleNamespace(example=example, port=port, kinds=kinds, port_kinds=kinds[port])


def config(module, kinds, **kw):
  """A tiny Gemma 3: a local and a global layer, grouped heads, query and key norms, post norms,
  both soft caps, and a query scalar (embed // heads)**-0.5 that is not head_dim**-0.5."""
  return module.TransformerConfig(
    **{
      **dict(
        num_layers=2,
        num_embed=64,
        embed_dim=48,
        hidden_dim=64,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        final_logit_softcap=30.0,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=kinds,
        query_pre_attn_scalar_value=12**-0.5,
        attn_logits_soft_cap=5.0,
        sliding_window_size=3,
        use_qk_norm=True,
      ),
      **kw,
    }
  )


def models(gemma, remat=False, **kw):
  """The example's model and the port, each made from seed 0 (the kinds: transformer_cfg's,
  made before any block was pasted)."""
  example, port = gemma.example, gemma.port
  original = example.Transformer(config(example, gemma.kinds[example], **kw), rngs=nnx.Rngs(0))
  ported = port.Transformer(config(port, gemma.kinds[port], **kw), rngs=nnx.Rngs(0), remat=remat)
  return original, ported


def flat(module):
  return [(jax.tree_util.keystr(p), v[...]) for p, v in nnx.to_flat_state(nnx.state(module))]


def test_the_port_draws_the_examples_parameters(gemma):
  original, ported = models(gemma)
  want, got = flat(original), flat(ported)
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, g), (_, w) in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w, err_msg=path)


TOKENS = jax.random.randint(jax.random.key(1), (B, T), 1, 64, jnp.int32)
INPUT_MASK = jnp.arange(T)[None, :] < jnp.array([[T], [T - 3]])  # the second row padded
SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0, 0]])  # packed; 0: padding


def masks(port):
  causal = make_causal_attn_mask(INPUT_MASK)
  packed = causal & (SEGMENTS[:, :, None] == SEGMENTS[:, None, :])
  return {
    "causal-padded": causal,  # eval_step's
    "causal-padded-CausalMask": port.CausalMask(INPUT_MASK),  # train.py's, ported
    "packed": packed,
    "packed-CausalMask": port.CausalMask(INPUT_MASK, SEGMENTS),
    "load_from_params": jnp.ones((B, 1, T), bool),  # Flax's test: every key, one row
    "bidirectional-padded": jnp.broadcast_to(INPUT_MASK[:, None, :], (B, T, T)),
  }


# By default: train.py's packed batch as the port hands it over, Flax's one-row all-ones mask (an
# array, as eval_step's causal and padded one, whose attention test_the_guides_attend_is_the_
# examples_attention[causal-local] checks by default); the other forms of each with -m exhaustive.
MASKS = [
  pytest.param("causal-padded", marks=pytest.mark.exhaustive),
  pytest.param("causal-padded-CausalMask", marks=pytest.mark.exhaustive),
  pytest.param("packed", marks=pytest.mark.exhaustive),
  "packed-CausalMask",
  "load_from_params",
  pytest.param("bidirectional-padded", marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("name", MASKS)
def test_the_ports_logits_are_the_examples(gemma, name):
  """On every token that is not padding (a padding token may see no key: 0 from jaxact, the
  values' mean from the example; no real token reads it)."""
  original, ported = models(gemma)
  mask = masks(gemma.port)[name]
  dense = mask.dense() if isinstance(mask, gemma.port.CausalMask) else mask
  positions = gemma.example.build_positions_from_mask(INPUT_MASK)
  want, _ = jax.jit(lambda m: original(TOKENS * INPUT_MASK, positions, None, m))(dense)
  got, _ = jax.jit(lambda m: ported(TOKENS * INPUT_MASK, positions, None, m))(mask)
  real = np.asarray(INPUT_MASK)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, rtol=1e-5)


@jax.enable_x64(False)  # the example's cache indices mix int32 and Python ints, as in its run
def test_with_a_cache_the_port_runs_the_examples_lines(gemma):
  """The sampler's call: a cache, and (for the ported class) a CausalMask made dense."""
  original, ported = models(gemma)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = make_causal_attn_mask(jnp.ones((B, T), bool))
  want, want_cache = jax.jit(original)(TOKENS, positions, original.init_cache(T, B), mask)
  causal = gemma.port.CausalMask(jnp.ones((B, T), bool))
  got, got_cache = jax.jit(ported)(TOKENS, positions, ported.init_cache(T, B), causal)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def _train_step(module, model, batch):
  """train.py's step as train.py runs it by default: jax.jit, with_capture (its sow_config is a
  dict, never None), label smoothing; SGD of rate 1 so that the new parameters carry the
  gradients. The ported step's metrics count the accuracy as the page says."""
  optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
  ported = module.jax_train_step.__doc__.startswith("train.py's step, ported")
  accuracy = nnx.metrics.Average("correct") if ported else nnx.metrics.Accuracy()
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=accuracy)
  rngs = nnx.Rngs(params=0, dropout=0)
  run = functools.partial(module.jax_train_step, with_capture=True)  # train.py's partial
  step = jax.jit(run, static_argnames=("label_smoothing", "pad_id"))
  updates, _ = step(model, optimizer, rngs, batch, metrics, 0.1, 0)
  nnx.update((model, optimizer, rngs, metrics), updates)
  return flat(model), {k: float(v) for k, v in metrics.compute().items()}


@pytest.mark.exhaustive  # the suite's time; the port without remat runs by default
@jax.enable_x64(False)  # as train.py runs (Flax's metrics would cast float64 into float32)
def test_train_pys_step_ported_with_block_remat_is_the_examples(gemma):
  """A packed, padded batch; the port with remat=True under jax.jit (the step's rngs never
  enter nnx.remat at dropout 0; passed in, it raises TraceContextError)."""
  original, ported = models(gemma, remat=True)
  tokens = TOKENS * INPUT_MASK
  batch = dict(
    inputs=tokens,
    targets=jnp.roll(tokens, -1, axis=1),
    inputs_position=gemma.example.build_positions_from_mask(INPUT_MASK),
    inputs_segmentation=SEGMENTS,
  )
  start = flat(original)
  want, want_metrics = _train_step(gemma.example, original, batch)
  got, got_metrics = _train_step(gemma.port, ported, batch)
  assert got_metrics == pytest.approx(want_metrics, rel=1e-5)
  moved = 0
  for (path, g), (_, w), (_, s) in zip(got, want, start, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5, err_msg=path)
    moved += not np.allclose(w, s)
  assert moved > 10  # the step did train


@pytest.mark.exhaustive  # the default step's remat: test_train_pys_step_ported_with_block_remat...
@jax.enable_x64(False)
def test_the_ported_remat_takes_the_rngs_under_nnx_transforms_with_dropout(gemma):
  """dropout_rate > 0 trains under train.py's use_nnx_transforms="all": there the block remat
  must be handed the step's rngs (closed over, nnx.remat raises)."""
  _, ported = models(gemma, remat=True, dropout_rate=0.5)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  mask = gemma.port.CausalMask(jnp.ones((B, T), bool))

  @nnx.jit
  def grads(model, rngs):
    def loss(model, rngs):
      x, _ = model.hidden(TOKENS, positions, None, mask, rngs=rngs)
      return jnp.sum(x * x)

    return nnx.grad(loss)(model, rngs.fork())

  g1 = grads(ported, nnx.Rngs(dropout=0))
  g2 = grads(ported, nnx.Rngs(dropout=1))
  leaves = jax.tree.leaves(g1)
  assert all(np.isfinite(a).all() for a in leaves)
  assert not all(np.allclose(a, b) for a, b in zip(leaves, jax.tree.leaves(g2), strict=True))


def test_the_ported_feedforward_takes_the_examples_sharding_metadata(gemma):
  """ShardingConfig's `ffw_weight_df` / `fd` are PartitionSpecs: the ported class hands them to
  GatedMLP as nnx.Linear's mapping ({"out_sharding": ...})."""
  P = jax.sharding.PartitionSpec
  shd = gemma.port.ShardingConfig(
    ffw_weight_df=P("fsdp", "tensor"), ffw_weight_fd=P("tensor", "fsdp"), act_btd=P("fsdp")
  )
  mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    mlp = gemma.port.FeedForward(8, 32, rngs=nnx.Rngs(0), shd_config=shd)
    y = mlp(jnp.ones((2, 4, 8), jnp.float32))
  assert mlp.gate_proj.kernel.out_sharding == P("fsdp", "tensor")
  assert mlp.down_proj.kernel.out_sharding == P("tensor", "fsdp")
  assert y.shape == (2, 4, 8)


# -------------------------------------------------------------------- Gemma's attention alone

N, K, H, W = 4, 2, 8, 3
SCALAR = 12**-0.5  # (embed_dim // num_heads)**-0.5 with 12 of them a head: not H**-0.5
CAP = 5.0
LENGTHS = jnp.array([[T], [T - 2]])
PADDING = jnp.arange(T)[None, :] < LENGTHS  # the second row's last two tokens are padding


def attention_module(kinds, local: bool, dropout=None):
  """An example Attention's attributes, as its Block sets them."""
  return SimpleNamespace(
    attn_type=kinds[0] if local else kinds[1],
    sliding_window_size=W,
    query_pre_attn_scalar=SCALAR,
    attn_logits_soft_cap=CAP,
    dropout=dropout or nnx.Dropout(0.0),
    shd_config=SimpleNamespace(act_btnh=None),
  )


def qkv():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = 3 * jax.random.normal(kq, (B, T, N, H), jnp.float32)  # logits large enough to be capped
  k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
  v = jax.random.normal(kv, (B, T, K, H), jnp.float32)
  return q, k, v


ATTENTION_MASKS = {
  "load_from_params": jnp.ones((B, 1, T), bool),
  "padding_only": jnp.broadcast_to(PADDING[:, None, :], (B, T, T)),
  "causal": make_causal_attn_mask(PADDING),
}
CASES = [
  ("load_from_params", False),
  ("load_from_params", True),  # the example's band of a one-row mask
  ("padding_only", True),  # the symmetric window, both halves
  ("causal", True),
]
LOCAL_ROW, EXH = ("load_from_params", True), pytest.mark.exhaustive


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


def close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# The band of a one-row mask by default: test_attend_reads_the_layers_kind_by_name (the same call).
@pytest.mark.parametrize(
  "name, local",
  [
    pytest.param(
      m, w, id=f"{m}-{'local' if w else 'global'}", marks=EXH if (m, w) == LOCAL_ROW else ()
    )
    for m, w in CASES
  ],
)
def test_the_guides_attend_is_the_examples_attention(gemma, name, local):
  attn, mask = attention_module(gemma.port_kinds, local), ATTENTION_MASKS[name]
  q, k, v = qkv()
  want = values_and_grads(example(attn, mask), q, k, v)
  close(values_and_grads(lambda q, k, v: gemma.port.attend(attn, q, k, v, mask), q, k, v), want)


def test_attend_reads_the_layers_kind_by_name(gemma):
  """An AttentionType defined anew (a copy of the example's enum) is still a local layer."""
  import enum

  copy = enum.Enum("AttentionType", {"GLOBAL": 1, "LOCAL_SLIDING": 2})
  attn = attention_module((copy.LOCAL_SLIDING, copy.GLOBAL), local=True)
  mask, (q, k, v) = ATTENTION_MASKS["load_from_params"], qkv()
  want = values_and_grads(example(attention_module(gemma.port_kinds, True), mask), q, k, v)
  close(values_and_grads(lambda q, k, v: gemma.port.attend(attn, q, k, v, mask), q, k, v), want)


def test_the_guides_causal_form_is_the_examples_under_train_pys_mask(gemma):
  """`attend_causal` of a CausalMask with padding and packed segments, against the example
  under make_causal_attn_mask and the segment mask train.py adds."""
  attn = attention_module(gemma.port_kinds, local=True)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]])
  causal = gemma.port.CausalMask(PADDING, segments)
  q, k, v = qkv()
  want = values_and_grads(example(attn, causal.dense()), q, k, v)
  # Every query sees a key here (itself, or for padding the real tokens before it).
  close(values_and_grads(lambda *a: gemma.port.attend_causal(attn, *a, causal), q, k, v), want)


def test_the_guides_attention_drops_out_as_the_examples_module_says(gemma):
  """Dropout is off in the deterministic view (train.py's eval model), on otherwise."""
  q, k, v = qkv()
  mask = ATTENTION_MASKS["causal"]
  off = attention_module(gemma.port_kinds, True, nnx.Dropout(0.5, deterministic=True))
  on = attention_module(gemma.port_kinds, True, nnx.Dropout(0.5))
  attend = gemma.port.attend

  @jax.jit
  def run(q, k, v, mask):
    plain = attend(attention_module(gemma.port_kinds, True), q, k, v, mask)
    dropped = attend(on, q, k, v, mask, rngs=nnx.Rngs(dropout=0))
    return plain, attend(off, q, k, v, mask), dropped

  plain, deterministic, dropped = run(q, k, v, mask)
  np.testing.assert_array_equal(deterministic, plain)
  assert not np.allclose(dropped, plain)


# ------------------------------------------------------------------------------------ ResNet


@pytest.fixture(scope="module")
def resnet():
  with pytest.MonkeyPatch.context() as mp:
    example = _fresh_copy("resnet_example", "resnet_example_original", mp)
    port = _fresh_copy("resnet_example", "resnet_example_port", mp, ("models.py",))
    _paste(port, ("models.py",))
    first = next(i for i, b in enumerate(PLAIN) if "class DropInBlock(" in b)
    last = next(i for i, b in enumerate(PLAIN) if "def to_conv_norm_act(" in b)
    namespace = {"__name__": "porting_guide_resnet"}
    for i in range(first, last + 1):
      code = compile(PLAIN[i], f"porting-flax.md (python block {i + 1})", "exec", dont_inherit=True)
      exec(code, namespace)
    yield SimpleNamespace(example=example, port=port, convert=namespace["to_conv_norm_act"])


# ResNet-50's block by default, ResNet-18's with -m exhaustive
BLOCKS = [pytest.param("ResNetBlock", marks=pytest.mark.exhaustive), "BottleneckResNetBlock"]


def resnets(resnet, block, dtype=jnp.float64):
  kw = dict(stage_sizes=[1, 1], num_classes=10, num_filters=4, dtype=dtype)
  original = resnet.example.ResNet(block_cls=getattr(resnet.example, block), **kw)
  return original, resnet.port.ResNet(block_cls=getattr(resnet.port, block), **kw)


def checkpoint(resnet, original, x):
  """The example's variables, moved off their initial values (no zero scale left), and their
  conversion by the page's to_conv_norm_act."""
  variables = jax.jit(functools.partial(original.init, train=False))(jax.random.key(1), x)
  moved = jax.tree_util.tree_map_with_path(
    lambda p, a: (
      a + 0.1 * jax.random.uniform(jax.random.key(len(jax.tree_util.keystr(p))), a.shape)
    ),
    variables,
  )
  return moved, {collection: resnet.convert(tree) for collection, tree in moved.items()}


def pmapped(fn):
  """train.py's pmap over one device (its axis_name: "batch"); arguments but the last shared."""
  return lambda *args: jax.tree.map(
    lambda a: a[0],
    jax.pmap(
      fn, axis_name="batch", in_axes=(*[None] * (len(args) - 1), 0), devices=jax.devices()[:1]
    )(*args[:-1], args[-1][None]),
  )


@pytest.mark.parametrize("block", BLOCKS)
def test_the_converted_checkpoint_is_the_ported_models_tree_and_runs_it(resnet, block):
  """Stem to head: nothing dropped, nothing left over (linen's apply would ignore it); train
  mode under pmap (batch statistics over the "batch" axis) and eval mode, in float64."""
  original, ported = resnets(resnet, block)
  x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3), jnp.float64)
  variables, converted = checkpoint(resnet, original, x)
  shapes = lambda tree: jax.tree.map(jnp.shape, tree)
  init = functools.partial(ported.init, train=False)
  assert shapes(converted) == shapes(jax.eval_shape(init, jax.random.key(1), x))
  assert "Dense_0" in converted["params"]
  # the units average their statistics over train.py's "batch" axis: outside it they cannot
  with pytest.raises(NameError, match="unbound axis name: batch"):
    jax.eval_shape(lambda v: ported.apply(v, x, mutable=["batch_stats"]), converted)
  train = lambda model: pmapped(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))
  want, want_stats = train(original)(variables, x)
  got, got_stats = train(ported)(converted, x)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  close_tree(got_stats, resnet.convert(want_stats), 1e-12)
  # eval: Flax's running averages are float32, and Flax takes rsqrt(var + epsilon) in float32
  # where jaxact takes it in x's float64 (1.6e-7 apart; jaxact's is the float64 formula's)
  evaluate = lambda model, v: jax.jit(functools.partial(model.apply, train=False))(v, x)
  np.testing.assert_allclose(evaluate(ported, converted), evaluate(original, variables), atol=2e-6)


def close_tree(got, want, tol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.exhaustive  # the gradients of ConvNormAct against Flax's: tests/norm_act
def test_train_pys_step_on_the_ported_resnet_is_the_examples(resnet):
  """Weight decay, the gradient pmean'd, SGD with Nesterov momentum, the statistics pmean'd."""
  original, ported = resnets(resnet, "BottleneckResNetBlock")
  x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3), jnp.float64)
  batch = {"image": x, "label": jnp.array([1, 2, 3, 4])}
  variables, converted = checkpoint(resnet, original, x)

  def step(model, v):
    params, stats = v["params"], v["batch_stats"]
    momentum = optax.sgd(0.1, momentum=0.9, nesterov=True).init(params)
    run = functools.partial(resnet.example.train_step, model.apply)
    one = jax.tree.map(lambda a: a[None], (params, stats, momentum, batch))
    return jax.tree.map(lambda a: a[0], jax.pmap(run, axis_name="batch")(*one))

  want, got = step(original, variables), step(ported, converted)
  close_tree(got[0], resnet.convert(want[0]), 1e-11)  # the new parameters
  close_tree(got[1], resnet.convert(want[1]), 1e-11)  # the batch statistics
  close_tree(got[3], want[3], 1e-11)  # loss and accuracy


def test_the_ported_units_keep_the_examples_dtype(resnet):
  """half_precision's bfloat16: every unit's output is bfloat16, as the example's units are."""
  _, ported = resnets(resnet, "BottleneckResNetBlock", jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3), jnp.bfloat16)
  variables = jax.jit(functools.partial(ported.init, train=False))(jax.random.key(1), x)
  run = functools.partial(ported.apply, train=False, capture_intermediates=True, mutable=True)
  _, state = jax.jit(run)(variables, x)
  units = {
    jax.tree_util.keystr(path): leaf.dtype
    for path, leaf in jax.tree_util.tree_leaves_with_path(state["intermediates"])
    if any("ConvNormAct" in str(k) or "stem" in str(k) or "proj" in str(k) for k in path)
  }
  assert len(units) >= 5 and set(units.values()) == {jnp.dtype(jnp.bfloat16)}, units


# ------------------------------------------------------------------------------ the H100 recipe


def test_the_h100_recipe_runs_as_written(tmp_path, monkeypatch):
  """The page's block beside the target config jax's installed CUDA plugin carries, saved as
  the page says; it compiles for the H100 (its device kind) and reads the memory analysis."""
  try:
    spec = support.target_config(support.H100)
  except support.Unavailable as e:
    pytest.skip(str(e))
  (tmp_path / "h100_sxm.txtpb").write_text(spec)
  monkeypatch.chdir(tmp_path)
  block = next(b for b in PLAIN if "def compile_for_gpu(" in b)
  namespace = {"__name__": "porting_guide_h100"}
  exec(compile(block, "porting-flax.md (the H100 recipe)", "exec", dont_inherit=True), namespace)
  compiled = namespace["compiled"]
  assert namespace["temp"] > 0
  assert "cuda" in compiled.as_text().lower() or "gpu" in compiled.as_text().lower()
