"""Writes the notebooks in this folder: `python notebooks/build.py`.

The notebooks are generated so that their cells stay reviewable as code and their Colab links and
install commands follow the repository URL in pyproject.toml. They are committed executed, so that
GitHub and the docs site show their outputs and plots: `python notebooks/build.py` writes the cells
and runs each notebook in this interpreter (nbclient; about a minute each on a CPU);
`--no-execute` writes them without outputs. tests/repo/test_notebooks.py executes each one again and
checks that the committed cells, outputs aside, are the ones written here.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import tempfile
import textwrap
import tomllib

import nbformat
from nbformat import v4

HERE = pathlib.Path(__file__).resolve().parent
PYPROJECT = tomllib.loads((HERE.parent / "pyproject.toml").read_text())
REPOSITORY = PYPROJECT["project"]["urls"]["Repository"].rstrip("/")  # https://github.com/o/r
GITHUB_PATH = REPOSITORY.removeprefix("https://github.com/")


def colab_badge(name: str) -> str:
  url = f"https://colab.research.google.com/github/{GITHUB_PATH}/blob/main/notebooks/{name}"
  return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def install_cell(*extra: str) -> str:
  packages = " ".join([f'"jaxact @ git+{REPOSITORY}"', *extra])
  return f"""\
import sys

# On Colab, install jaxact from GitHub; elsewhere, install it first (see the README's Quick start).
if "google.colab" in sys.modules:
  %pip install -q {packages}"""


def md(text: str):
  return v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
  return v4.new_code_cell(textwrap.dedent(text).strip())


def notebook(cells) -> nbformat.NotebookNode:
  """A notebook of copies of `cells`, with ids that do not change from one build to the next."""
  cells = [nbformat.from_dict(dict(cell, id=f"cell-{i}")) for i, cell in enumerate(cells)]
  nb = v4.new_notebook(cells=cells)
  nb.metadata = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
    "colab": {"provenance": []},
  }
  return nb


QUICKSTART = [
  md(
    f"""
    # jaxact quick start

    {colab_badge("01_quickstart.ipynb")}

    [jaxact]({REPOSITORY}) is every `jax.nn` activation, name for name, as a `jax.custom_vjp` that
    keeps only its output for the backward pass where the derivative can be written from it, and
    never gives NaN for a finite input. This notebook shows the drop-in use, the gradients where
    jax.nn's turn NaN, and the training memory saved, read from XLA's compiled memory analysis.
    It runs on a CPU in about a minute.
    """
  ),
  code(install_cell()),
  code(
    """
    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np

    import jaxact

    print(f"jax {jax.__version__} on {jax.default_backend()}, jaxact {jaxact.__version__}")
    """
  ),
  md(
    """
    ## Drop-in use

    Same names, signatures, defaults and output dtype as `jax.nn`: replace `jax.nn.gelu` with
    `jaxact.gelu`. The values agree to rounding.
    """
  ),
  code(
    """
    x = jnp.linspace(-6.0, 6.0, 1001, dtype=jnp.float32)
    for name in ["relu", "gelu", "silu", "softplus", "sigmoid", "tanh", "elu", "mish"]:
      diff = jnp.max(jnp.abs(getattr(jaxact, name)(x) - getattr(jax.nn, name)(x)))
      print(f"{name:9s} max |jaxact - jax.nn| = {diff:.1e}")
    """
  ),
  md(
    """
    In a model, the activation is one name to change. `jaxact.dense_bias_act` goes further: it
    fuses `act(x @ w + b)` into one op that keeps only the output (`jaxact.conv_bias_act` does the
    same for a convolution; `jaxact.linen.DenseAct` / `ConvAct` wrap them as Flax layers).
    """
  ),
  code(
    """
    def mlp(params, x, act=jaxact.gelu):  # was: act=jax.nn.gelu
      for w, b in params:
        x = act(x @ w + b)
      return x


    def mlp_fused(params, x, activation="gelu"):
      for w, b in params:
        x = jaxact.dense_bias_act(x, w, b, activation=activation)
      return x


    keys = jax.random.split(jax.random.key(0), 4)
    params = [(jax.random.normal(k, (64, 64)) / 8, jnp.zeros(64)) for k in keys[:3]]
    x = jax.random.normal(keys[3], (32, 64))
    loss = lambda f: lambda p: jnp.sum(f(p, x) ** 2)
    g_ref = jax.grad(loss(lambda p, x: mlp(p, x, jax.nn.gelu)))(params)
    g_fused = jax.grad(loss(mlp_fused))(params)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_ref, g_fused)
    print("max gradient difference, fused vs jax.nn:", max(jax.tree.leaves(diff)))
    """
  ),
  md(
    """
    ## Gradients that never turn NaN

    Across the whole float32 range, up to `finfo(float32).max` ≈ 3.4e38, jax.nn's `gelu` gradient
    becomes NaN once `x**3` overflows (|x| > 1e19), and `squareplus`'s is wrong (0.5 instead of 1
    or 0) from the same point and NaN at the top of the range. In float16 `gelu`'s gradient is NaN
    from |x| ≈ 150. jaxact's are finite and correct everywhere (crosses: jax.nn's NaNs).
    """
  ),
  code(
    """
    def grad_curve(f, dtype, top):
      mags = np.logspace(-3, np.log10(top), 300).astype(dtype)
      x = jnp.asarray(np.concatenate([-mags[::-1], [0], mags]).astype(dtype))
      g = jax.grad(lambda v: jnp.sum(f(v).astype(jnp.float32)))(x)
      return np.asarray(x, np.float64), np.asarray(g, np.float64)


    f32_max = float(jnp.finfo(jnp.float32).max)
    f16_max = float(jnp.finfo(jnp.float16).max)
    f32_ticks = [-1e30, -1e20, -1e10, -1, 0, 1, 1e10, 1e20, 1e30]
    f16_ticks = [-1e4, -1e2, -1, 0, 1, 1e2, 1e4]
    cases = [
      ("gelu", np.float32, f32_max, f32_ticks),
      ("squareplus", np.float32, f32_max, f32_ticks),
      ("gelu", np.float16, f16_max, f16_ticks),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, (name, dtype, top, ticks) in zip(axes, cases, strict=True):
      for lib, style in ((jax.nn, dict(color="gray", lw=3, alpha=0.6)), (jaxact, dict(color="C3"))):
        x, g = grad_curve(getattr(lib, name), dtype, top)
        nan = ~np.isfinite(g)
        ax.plot(x, np.where(nan, np.nan, g), label=f"{lib.__name__}.{name}", **style)
        if nan.any():
          ax.plot(
            x[nan],
            np.full(nan.sum(), -0.15),
            "x",
            color="black",
            ms=4,
            label=f"{lib.__name__}: NaN ({nan.sum()})",
          )
        print(f"{np.dtype(dtype).name:8s} {lib.__name__}.{name}: {nan.sum()} NaN gradients")
      ax.set_xscale("symlog", linthresh=1e-3)
      ax.set_xticks(ticks, [f"{t:.0e}" if abs(t) > 1 else f"{t:g}" for t in ticks], fontsize=7)
      ax.set_title(f"d/dx {name}(x), {np.dtype(dtype).name}")
      ax.set_xlabel("x")
      ax.legend(fontsize=8)
    fig.tight_layout()
    """
  ),
  md(
    """
    ## Training memory

    `jax.jit(f).lower(...).compile().memory_analysis()` reports the temporary memory XLA
    allocates for a compiled function. For the gradient of an 8-layer MLP (8192 x 512 float32
    activations, 16 MiB each) jax.nn keeps the pre-activation and intermediates of every layer;
    jaxact keeps the output alone (L + 1 = 9 buffers) or, for gelu, silu and mish, whose
    derivative the output does not determine, the input. Nothing is run: this only compiles.
    """
  ),
  code(
    """
    LAYERS, BATCH, WIDTH = 8, 8192, 512
    BUFFER = BATCH * WIDTH * 4  # bytes of one activation
    ws = [jnp.zeros((WIDTH, WIDTH), jnp.float32) for _ in range(LAYERS)]
    bs = [jnp.zeros((WIDTH,), jnp.float32) for _ in range(LAYERS)]
    x = jnp.zeros((BATCH, WIDTH), jnp.float32)


    def temp_buffers(layer):
      def loss(ws, bs, x):
        for w, b in zip(ws, bs, strict=True):
          x = layer(x, w, b)
        return jnp.sum(x)

      compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(ws, bs, x).compile()
      return compiled.memory_analysis().temp_size_in_bytes / BUFFER


    def composed(act):
      return lambda x, w, b: act(x @ w + b)


    def fused(name):
      return lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=name)


    names = ["relu", "elu", "softplus", "tanh", "gelu", "silu", "mish"]
    rows = {}
    for name in names:
      rows[name] = (
        temp_buffers(composed(getattr(jax.nn, name))),
        temp_buffers(composed(getattr(jaxact, name))),
        temp_buffers(fused(name)),
      )
      print(
        f"{name:9s} jax.nn {rows[name][0]:4.0f}   jaxact {rows[name][1]:4.0f}   "
        f"dense_bias_act {rows[name][2]:4.0f}  buffers"
      )
    """
  ),
  code(
    """
    labels = ["jax.nn", "jaxact activation", "jaxact.dense_bias_act"]
    colors = ["#9e9e9e", "#f2a65a", "#e4572e"]
    pos = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for i, (label, color) in enumerate(zip(labels, colors, strict=True)):
      values = [rows[n][i] * BUFFER / 2**20 for n in names]
      bars = ax.bar(pos + (i - 1) * 0.27, values, 0.27, label=label, color=color)
      ax.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(pos, names)
    ax.set_ylabel("compiled temp memory (MiB)")
    ax.set_title(f"{LAYERS}-layer MLP, {BATCH} x {WIDTH} float32: jit(grad(loss))")
    ax.legend()
    fig.tight_layout()
    """
  ),
  md(
    """
    The benchmark suite measures all of this and more (step time, Flax models with and without
    remat, NaN counts per dtype) on your machine: `python -m benchmarks --quick`. The next
    notebook trains a Flax model with jaxact layers:
    [02_flax_training.ipynb](02_flax_training.ipynb).
    """
  ),
]


FLAX_TRAINING = [
  md(
    f"""
    # Training a Flax model with jaxact layers

    {colab_badge("02_flax_training.ipynb")}

    `jaxact.linen.DenseAct` and `ConvAct` are `nn.Dense` and `nn.Conv` with one more attribute,
    `activation`: the same parameters (names, shapes, initializers), computed as one fused op that
    keeps only the layer's output for the backward pass. This notebook trains the same small CNN
    on scikit-learn's bundled digits data set (1797 8x8 images, no download) written both ways,
    from the same initial parameters, and compares the loss curves, the accuracy, the compiled
    memory of a training step and its time. It runs on a CPU in under a minute.
    """
  ),
  code(install_cell("optax", "scikit-learn")),
  code(
    """
    import time

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from jaxact.linen import ConvAct, DenseAct

    print(f"jax {jax.__version__} on {jax.default_backend()}")
    """
  ),
  md("## Data"),
  code(
    """
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # NHWC, values in [0, 1]
    x_train, x_test, y_train, y_test = train_test_split(
      images, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    print("train", x_train.shape, "test", x_test.shape)
    """
  ),
  md(
    """
    ## The model, written twice

    Only the layers differ. Naming the layers makes the two parameter trees identical, so one
    initialization (or checkpoint) serves both.
    """
  ),
  code(
    """
    class FlaxCNN(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(64, (3, 3), name="conv2")(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(128, name="dense")(x))
        return nn.Dense(10, name="head")(x)


    class JaxactCNN(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = ConvAct(32, (3, 3), activation="relu", name="conv1")(x)
        x = ConvAct(64, (3, 3), activation="relu", name="conv2")(x)
        x = x.reshape(x.shape[0], -1)
        x = DenseAct(128, activation="relu", name="dense")(x)
        return nn.Dense(10, name="head")(x)


    params = FlaxCNN().init(jax.random.key(0), x_train[:1])
    same = jax.tree.map(jnp.shape, params) == jax.tree.map(
      jnp.shape, JaxactCNN().init(jax.random.key(0), x_train[:1])
    )
    print("same parameter names and shapes:", same)
    """
  ),
  md("## Training"),
  code(
    """
    optimizer = optax.adam(1e-3)


    def make_step(model):
      def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

      @jax.jit
      def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

      return step


    def accuracy(model, params, x, y):
      return float(jnp.mean(jnp.argmax(model.apply(params, x), -1) == y))


    EPOCHS, BATCH = 12, 64
    curves, accuracies = {}, {}
    for label, model in (("Flax", FlaxCNN()), ("jaxact", JaxactCNN())):
      step = make_step(model)
      p, opt_state = params, optimizer.init(params)
      rng = np.random.default_rng(0)  # the same batches for both
      losses = []
      for _ in range(EPOCHS):
        order = rng.permutation(len(x_train))
        for i in range(0, len(order) - BATCH + 1, BATCH):
          idx = order[i : i + BATCH]
          p, opt_state, loss = step(p, opt_state, x_train[idx], y_train[idx])
          losses.append(float(loss))
      curves[label] = losses
      accuracies[label] = accuracy(model, p, x_test, y_test)
      final = np.mean(losses[-20:])
      print(f"{label:7s} final loss {final:.4f}, test accuracy {accuracies[label]:.3f}")
    """
  ),
  code(
    """
    fig, ax = plt.subplots(figsize=(8, 3.5))
    styles = (dict(lw=3, alpha=0.5), dict(ls="--"))
    for (label, losses), style in zip(curves.items(), styles, strict=True):
      ax.plot(losses, label=f"{label} (test accuracy {accuracies[label]:.3f})", **style)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    """
  ),
  md(
    """
    The curves lie on top of each other: the fused layers compute the same function and the same
    gradients (up to floating-point rounding), with less memory.

    ## Memory and time of a training step

    Each way to train the model is a point: the compiled temporary memory of its training step
    (forward, backward and the Adam update, from XLA's memory analysis, at a batch of 2048) against
    its step time relative to Flax's, the two steps run alternately.
    """
  ),
  code(
    """
    xb = jnp.asarray(np.resize(x_train, (2048, 8, 8, 1)))
    yb = jnp.asarray(np.resize(y_train, (2048,)))
    opt_state = optimizer.init(params)
    steps, memory = {}, {}
    for label, model in (("Flax", FlaxCNN()), ("jaxact", JaxactCNN())):
      steps[label] = make_step(model)
      compiled = steps[label].lower(params, opt_state, xb, yb).compile()
      memory[label] = compiled.memory_analysis().temp_size_in_bytes / 2**20

    times = {label: [] for label in steps}
    for r in range(16):
      for label in ("Flax", "jaxact") if r % 2 else ("jaxact", "Flax"):
        start = time.perf_counter()
        jax.block_until_ready(steps[label](params, opt_state, xb, yb))
        times[label].append(time.perf_counter() - start)
    median = {label: float(np.median(t[1:])) * 1e3 for label, t in times.items()}  # t[0]: warm-up
    relative = {label: median[label] / median["Flax"] for label in steps}
    for label in steps:
      print(f"{label:7s} temp memory {memory[label]:6.1f} MiB   step {median[label]:6.1f} ms")
    print(
      f"jaxact / Flax: memory {memory['jaxact'] / memory['Flax']:.2f}, "
      f"time {relative['jaxact']:.2f}"
    )
    """
  ),
  code(
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for label, color in (("Flax", "#5b8bd0"), ("jaxact", "#e4572e")):
      ax.scatter(memory[label], relative[label], s=50, color=color, zorder=3)
      ax.annotate(
        f"{label}: {memory[label]:.0f} MiB, {relative[label]:.2f}x",
        (memory[label], relative[label]),
        xytext=(8, 4),
        textcoords="offset points",
      )
    ax.axhline(1, color="#5b8bd0", lw=0.7, ls=":")
    ax.set_xlim(0, max(memory.values()) * 1.5)
    ax.set_ylim(min(relative.values()) - 0.15, max(relative.values()) + 0.15)
    ax.set_xlabel("compiled temp memory of a training step (MiB)")
    ax.set_ylabel("step time / Flax's")
    ax.set_title("The CNN's training step, two ways: lower and further left is better")
    fig.tight_layout()
    """
  ),
  md(
    """
    The benchmark suite draws the same picture at scale, with every way to train each model (an
    8-layer MLP, a 6-layer CNN, a gated MLP stack, a decoder step; each layer or block under each
    remat policy; gelu's few-bit codes) and the Pareto front: `python -m benchmarks --quick`.
    """
  ),
]


GRPO = [
  md(
    f"""
    # GRPO on a toy reward, without the logits

    {colab_badge("03_grpo.ipynb")}

    `jaxact.policy_gradient_loss` is the clipped policy-gradient loss of GRPO (and of DAPO,
    Dr. GRPO, GSPO and PPO) from the policy's final hidden states and its head: the per-token
    log-probabilities come from `jaxact.linear_log_probs`, which never builds the
    (tokens, vocabulary) logits. This notebook trains a tiny autoregressive policy with GRPO on a
    verifiable toy reward: groups of completions sampled for each prompt, group-relative
    advantages, the clipped surrogate against the sampling policy's log-probabilities and a KL
    penalty towards a frozen reference. It then checks the loss against the plain composition
    (`log_softmax` of the full logits) and compares the two's compiled memory at a vocabulary of
    32768. It runs on a CPU in well under a minute.
    """
  ),
  code(install_cell("optax")),
  code(
    """
    import time

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax

    import jaxact

    print(f"jax {jax.__version__} on {jax.default_backend()}, jaxact {jaxact.__version__}")
    """
  ),
  md(
    """
    ## The task and the policy

    A prompt is one token `s` of a vocabulary of 16. The policy writes 8 tokens, and the reward is
    the fraction of them that count up by one from the token before (`s + 1, s + 2, ...`, modulo
    16): checked by a rule, no reward model, and 1/16 for a policy that writes at random.

    The policy is a tiny autoregressive model: the previous token's embedding, through a residual
    MLP of `jaxact.dense_bias_act` layers, gives the final hidden state `x` (32 features), and the
    head `w` (32 x 16) its next-token logits. It sees only the previous token, which is all this
    task needs. Sampling runs the model one position at a time (`jax.random.categorical` of the
    logits); training runs it over the whole completion at once and gives the hidden states and
    the head to the loss.
    """
  ),
  code(
    """
    V, T, D, HIDDEN = 16, 8, 32, 64  # vocabulary, completion length, features, MLP width
    PROMPTS, GROUP = 16, 8  # each step: 16 prompts, a group of 8 completions for each


    def init(key):
      k = jax.random.split(key, 4)
      return {
        "embed": jax.random.normal(k[0], (V, D)) * 0.5,
        "w1": jax.random.normal(k[1], (D, HIDDEN)) * D**-0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k[2], (HIDDEN, D)) * HIDDEN**-0.5,
        "b2": jnp.zeros(D),
        "head": jax.random.normal(k[3], (D, V)) * D**-0.5,
      }


    def hidden(params, prev):
      # The final hidden state after each previous token: (...,) -> (..., D).
      h = params["embed"][prev]
      u = jaxact.dense_bias_act(h, params["w1"], params["b1"], activation="gelu")
      return h + jaxact.dense_bias_act(u, params["w2"], params["b2"], activation="tanh")


    def sample(params, prompts, key):
      # One completion per prompt, a token at a time: (n,) -> (n, T).
      def step(prev, k):
        token = jax.random.categorical(k, hidden(params, prev) @ params["head"])
        return token, token

      _, tokens = jax.lax.scan(step, prompts, jax.random.split(key, T))
      return tokens.T


    def previous(prompts, tokens):
      # The token before each completion position: the prompt, then the completion shifted.
      return jnp.concatenate([prompts[:, None], tokens[:, :-1]], axis=1)


    def reward(prompts, tokens):
      return jnp.mean(tokens == (previous(prompts, tokens) + 1) % V, axis=-1)


    params = init(jax.random.key(0))
    reference = params  # the frozen reference of the KL penalty: the initial policy
    prompts = jnp.arange(4) * 4
    tokens = sample(params, prompts, jax.random.key(1))
    for s, y, r in zip(prompts, tokens, reward(prompts, tokens), strict=True):
      print(f"prompt {int(s):2d} -> {np.asarray(y)}  reward {float(r):.3f}")
    """
  ),
  md(
    """
    ## GRPO

    Each step samples a group of 8 completions for each of 16 random prompts and scores them. A
    completion's advantage is its reward less its group's mean, divided by the group's standard
    deviation (GRPO's group-relative advantage: no value model). The sampling policy's
    log-probabilities of the sampled tokens (`old_log_probs`) and the frozen reference's
    (`ref_log_probs`) come from `jaxact.linear_log_probs`; then two Adam steps on
    `policy_gradient_loss`: in the first the ratio to the sampling policy is 1 (the policy
    gradient), in the second the policy has moved and the clip (`epsilon` 0.2) can bind. `beta`
    weighs the KL penalty towards the reference.
    """
  ),
  code(
    """
    BETA, EPSILON, INNER_STEPS, STEPS = 0.02, 0.2, 2, 120
    optimizer = optax.adam(1e-2)


    @jax.jit
    def rollout(params, key):
      k_prompts, k_sample = jax.random.split(key)
      prompts = jnp.repeat(jax.random.randint(k_prompts, (PROMPTS,), 0, V), GROUP)
      tokens = sample(params, prompts, k_sample)
      rewards = reward(prompts, tokens).reshape(PROMPTS, GROUP)
      mean, std = rewards.mean(1, keepdims=True), rewards.std(1, keepdims=True)
      advantages = ((rewards - mean) / (std + 1e-4)).reshape(-1)  # one a completion
      return previous(prompts, tokens), tokens, advantages, rewards.mean()


    def loss_fn(params, prev, tokens, advantages, old_log_probs, ref_log_probs):
      x = hidden(params, prev)  # (sequences, T, D): no logits from here on
      return jaxact.policy_gradient_loss(
        x,
        params["head"],
        tokens,
        advantages,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        loss_type="grpo",
        epsilon=EPSILON,
        beta=BETA,
      )


    def log_probs(params, prev, tokens):
      return jaxact.linear_log_probs(hidden(params, prev), params["head"], tokens)


    @jax.jit
    def update(params, opt_state, prev, tokens, advantages):
      old = log_probs(params, prev, tokens)  # the sampling policy's, fixed for the inner steps
      ref = log_probs(reference, prev, tokens)
      for _ in range(INNER_STEPS):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, metrics), grads = grad_fn(params, prev, tokens, advantages, old, ref)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
      return params, opt_state, loss, metrics


    opt_state = optimizer.init(params)
    history = {"reward": [], "loss": [], "kl": [], "clip_fraction": []}
    start = time.perf_counter()
    for i in range(STEPS):
      if i == 10:
        early = params  # the policy of step 10, for the check against the full logits below
      prev, tokens, advantages, mean_reward = rollout(params, jax.random.key(100 + i))
      params, opt_state, loss, metrics = update(params, opt_state, prev, tokens, advantages)
      for name, value in (("reward", mean_reward), ("loss", loss)):
        history[name].append(float(value))
      for name in ("kl", "clip_fraction"):
        history[name].append(float(metrics[name]))
    print(f"{STEPS} GRPO steps in {time.perf_counter() - start:.1f} s")
    print(
      f"mean reward: first step {history['reward'][0]:.3f}, last 10 steps "
      f"{np.mean(history['reward'][-10:]):.3f}"
    )
    """
  ),
  code(
    """
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
    panels = (
      ("reward", "mean reward of the sampled completions"),
      ("loss", "policy_gradient_loss (last inner step)"),
      ("kl", "KL to the reference (k3)"),
    )
    for ax, (name, title) in zip(axes, panels, strict=True):
      ax.plot(history[name])
      ax.set_title(title)
      ax.set_xlabel("GRPO step")
    axes[0].axhline(1 / V, color="gray", ls=":", label="random policy")
    axes[0].legend()
    fig.tight_layout()

    tokens = sample(params, prompts, jax.random.key(1))
    for s, y, r in zip(prompts, tokens, reward(prompts, tokens), strict=True):
      print(f"prompt {int(s):2d} -> {np.asarray(y)}  reward {float(r):.3f}")
    """
  ),
  md(
    """
    The surrogate part of the loss stays near 0 (a group's advantages sum to 0: what moves the
    policy is their weighting of the log-probabilities' gradients, not the loss's value), so the
    loss follows its penalty, `beta` times the KL to the reference, which grows as the policy
    leaves the near-uniform initial policy for the rewarded completions; a larger `beta` holds it
    closer. A group whose completions all score alike has advantages 0 and teaches nothing: once
    the policy counts up every time, the steps have little left to learn from.

    ## The same loss from the full logits

    Written without jaxact, the loss builds the logits `x @ w`, their `log_softmax`, and picks the
    sampled tokens' entries. On one batch sampled by the policy of step 10 and scored after one
    more update of it (off the policy: the ratios are not 1, and the clip binds for some tokens)
    the two agree, values and gradients in `x` and `w`.
    """
  ),
  code(
    """
    def plain_grpo(x, w, tokens, advantages, old, ref):
      logits = x @ w  # (sequences, T, V): what policy_gradient_loss never builds
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]
      ratio, a = jnp.exp(logp - old), advantages[:, None]
      surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPSILON, 1 + EPSILON) * a)
      d = ref - logp
      kl = jnp.exp(d) - d - 1  # k3
      return -jnp.mean(jnp.mean(surrogate - BETA * kl, axis=-1))  # GRPO: per sequence, then all


    def ours(x, w, tokens, advantages, old, ref):
      return jaxact.policy_gradient_loss(
        x, w, tokens, advantages, old_log_probs=old, ref_log_probs=ref, epsilon=EPSILON, beta=BETA
      )[0]


    prev, tokens, advantages, _ = rollout(early, jax.random.key(0))
    old, ref = log_probs(early, prev, tokens), log_probs(reference, prev, tokens)
    moved = update(early, optimizer.init(early), prev, tokens, advantages)[0]  # one GRPO update
    x = hidden(moved, prev)
    args = (x, moved["head"], tokens, advantages, old, ref)
    _, metrics = loss_fn(moved, prev, tokens, advantages, old, ref)
    clip, ratio = float(metrics["clip_fraction"]), float(metrics["ratio"])
    print(f"clip fraction {clip:.3f}, mean ratio {ratio:.3f}")
    for label, f in (("jaxact", ours), ("plain", plain_grpo)):
      value, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(*args)
      print(
        f"{label:7s} loss {float(value):+.7f}  |dx| {float(jnp.linalg.norm(dx)):.6f}  "
        f"|dw| {float(jnp.linalg.norm(dw)):.6f}"
      )
    g_ours, g_plain = (jax.grad(f, argnums=(0, 1))(*args) for f in (ours, plain_grpo))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_ours, g_plain, strict=True))
    print(f"max gradient difference: {diff:.1e}")
    """
  ),
  md(
    """
    ## Memory at a real vocabulary

    At a vocabulary of 16 the logits are nothing. At 32768 (8 completions of 128 tokens, 64
    features) one float32 copy of them is 128 MiB, and the plain composition's gradient keeps
    several. XLA's compiled memory analysis of `jit(grad)` of the loss in `x` and `w` (only
    compiled, never run) reads the temporary memory each allocates.
    """
  ),
  code(
    """
    BIG_GROUP, BIG_T, BIG_D, BIG_V = 8, 128, 64, 32768
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    big = (
      f32(BIG_GROUP, BIG_T, BIG_D),  # x
      f32(BIG_D, BIG_V),  # w
      jax.ShapeDtypeStruct((BIG_GROUP, BIG_T), jnp.int32),  # tokens
      f32(BIG_GROUP),  # advantages
      f32(BIG_GROUP, BIG_T),  # old log-probs
      f32(BIG_GROUP, BIG_T),  # reference log-probs
    )
    logits_mib = BIG_GROUP * BIG_T * BIG_V * 4 / 2**20
    temp = {}
    for label, f in (("plain composition", plain_grpo), ("jaxact", ours)):
      compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(*big).compile()
      temp[label] = compiled.memory_analysis().temp_size_in_bytes / 2**20
      print(
        f"{label:18s} temp {temp[label]:7.1f} MiB  ({temp[label] / logits_mib:.2f} x the logits)"
      )
    print(f"jaxact / plain: {temp['jaxact'] / temp['plain composition']:.3f}")
    """
  ),
  md(
    """
    jaxact's temporary memory is a few blocks of the vocabulary, whatever the number of tokens;
    the plain composition's grows with tokens x vocabulary. The benchmark suite measures a real
    step (8 completions of 8192 tokens, V = 128256): `python -m benchmarks posttrain`. The next
    notebook distils a teacher into a smaller student the same way:
    [04_distillation.ipynb](04_distillation.ipynb).
    """
  ),
]


DISTILLATION = [
  md(
    f"""
    # Distilling a teacher into a smaller student, without the logits

    {colab_badge("04_distillation.ipynb")}

    `jaxact.distillation_loss` is a divergence between a student's and a teacher's next-token
    distributions (the forward KL of Hinton et al., the reverse KL, or GKD's generalized
    Jensen-Shannon divergence), at a temperature, from both models' final hidden states and heads:
    neither model's (tokens, vocabulary) logits are built, and the two models' feature sizes may
    differ. This notebook distils a fixed teacher (128 features) into students of 16 features
    with the forward KL and with the JSD, draws the divergences over the steps, checks the loss
    against the plain composition (`log_softmax` of both full logits) and compares the two's
    compiled memory at a vocabulary of 32768. It runs on a CPU in well under a minute.
    """
  ),
  code(install_cell("optax")),
  code(
    """
    import time

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax

    import jaxact

    print(f"jax {jax.__version__} on {jax.default_backend()}, jaxact {jaxact.__version__}")
    """
  ),
  md(
    """
    ## Teacher and student

    Both are next-token models over a vocabulary of 64 that see the previous token: its
    embedding through a residual MLP of `jaxact.dense_bias_act` layers gives the final hidden
    state, and the head its logits. The teacher is fixed: random weights, its head scaled up so
    that its next-token distributions are peaked (about 1 nat of entropy) and differ from one
    previous token to the next. The student is the same model with 16 features where the teacher
    has 128.
    """
  ),
  code(
    """
    V, TEACHER_D, STUDENT_D = 64, 128, 16


    def init(key, d, head_scale=1.0):
      k = jax.random.split(key, 4)
      return {
        "embed": jax.random.normal(k[0], (V, d)),
        "w1": jax.random.normal(k[1], (d, 2 * d)) * d**-0.5,
        "b1": jnp.zeros(2 * d),
        "w2": jax.random.normal(k[2], (2 * d, d)) * (2 * d) ** -0.5,
        "b2": jnp.zeros(d),
        "head": jax.random.normal(k[3], (d, V)) * head_scale * d**-0.5,
      }


    def hidden(params, prev):
      # The final hidden state after each previous token: (...,) -> (..., d).
      h = params["embed"][prev]
      u = jaxact.dense_bias_act(h, params["w1"], params["b1"], activation="gelu")
      return h + jaxact.dense_bias_act(u, params["w2"], params["b2"], activation="identity")


    teacher = init(jax.random.key(0), TEACHER_D, head_scale=4.0)
    every = jnp.arange(V)  # each previous token once: the whole task
    p = jax.nn.softmax(hidden(teacher, every) @ teacher["head"])
    entropy = -jnp.sum(p * jnp.log(p), -1)
    print(
      f"teacher: entropy {float(entropy.mean()):.2f} nats (uniform: {np.log(V):.2f}), "
      f"top token's probability {float(p.max(-1).mean()):.2f} on average"
    )
    """
  ),
  md(
    """
    ## Distillation

    Each step draws 256 previous tokens, runs both models to their hidden states and gives them,
    with both heads, to `distillation_loss` at temperature 2 (softer targets, Hinton's choice);
    the teacher is frozen (the loss gives its arguments zero gradients). One student is trained
    with the forward KL `KL(p || q)`, another from the same start with the JSD (`beta` 0.5). Every
    10 steps each student is scored by the forward KL at temperature 1 over every previous token
    and by how often its most likely next token is the teacher's.
    """
  ),
  code(
    """
    BATCH, STEPS, TEMPERATURE = 256, 300, 2.0
    optimizer = optax.adam(1e-2)
    teacher_x = hidden(teacher, every)


    def make_step(divergence):
      def loss_fn(student, prev):
        return jaxact.distillation_loss(
          hidden(student, prev),
          student["head"],
          hidden(teacher, prev),
          teacher["head"],
          divergence=divergence,
          temperature=TEMPERATURE,
        )[0]  # (loss, metrics): the metrics are the divergence and cross-entropy, unweighted

      @jax.jit
      def step(student, opt_state, key):
        prev = jax.random.randint(key, (BATCH,), 0, V)
        loss, grads = jax.value_and_grad(loss_fn)(student, prev)
        updates, opt_state = optimizer.update(grads, opt_state, student)
        return optax.apply_updates(student, updates), opt_state, loss

      return step


    @jax.jit
    def score(student):
      x = hidden(student, every)
      kl = jaxact.distillation_loss(x, student["head"], teacher_x, teacher["head"])[0]
      agree = jnp.mean(jnp.argmax(x @ student["head"], -1) == jnp.argmax(p, -1))
      return kl, agree


    curves, students = {}, {}
    start = time.perf_counter()
    for divergence in ("forward_kl", "jsd"):
      student, step = init(jax.random.key(1), STUDENT_D), make_step(divergence)
      opt_state = optimizer.init(student)
      curve = {"loss": [], "kl": [], "agree": []}
      for i in range(STEPS):
        student, opt_state, loss = step(student, opt_state, jax.random.key(i))
        curve["loss"].append(float(loss))
        if i % 10 == 9:
          kl, agree = score(student)
          curve["kl"].append(float(kl))
          curve["agree"].append(float(agree))
      curves[divergence], students[divergence] = curve, student
      print(
        f"{divergence:10s} KL at T=1 {curve['kl'][-1]:.4f}, top-1 agreement "
        f"{curve['agree'][-1]:.3f}"
      )
    print(f"{2 * STEPS} distillation steps in {time.perf_counter() - start:.1f} s")
    """
  ),
  code(
    """
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
    scored = np.arange(10, STEPS + 1, 10)
    for divergence, curve in curves.items():
      axes[0].plot(curve["loss"], label=divergence)
      axes[1].plot(scored, curve["kl"], label=divergence)
      axes[2].plot(scored, curve["agree"], label=divergence)
    titles = (
      f"training loss (its own divergence, T = {TEMPERATURE:g})",
      "forward KL to the teacher, T = 1",
      "top-1 agreement with the teacher",
    )
    for ax, title in zip(axes, titles, strict=True):
      ax.set_title(title)
      ax.set_xlabel("step")
      ax.legend()
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.tight_layout()
    """
  ),
  md(
    """
    The JSD is bounded (by log 2 for `beta` 0.5) and weighs the student's own mass as well as the
    teacher's, so its value runs lower than the forward KL's; scored by the forward KL, the student
    trained on it is the further from the teacher, as expected of a loss that does not ask for
    the teacher's whole distribution. Both agree with the teacher's top token almost everywhere.
    The training losses level off above 0: 16 features cannot reproduce the teacher's whole table
    of next-token logits (a student of 64 features, in the same steps, brings the forward KL at
    temperature 2 to about 0.01), and temperature 2 spreads the targets over the unlikely tokens
    where that shows, while at temperature 1 the likely tokens dominate.

    ## The same loss from the full logits

    Written without jaxact, each divergence builds both models' logits and their
    `log_softmax`; the teacher's are detached. On one batch the values and the student's
    gradients agree.
    """
  ),
  code(
    """
    def plain_distillation(x, w, teacher_x, teacher_w, divergence, beta=0.5):
      log_q = jax.nn.log_softmax(x @ w / TEMPERATURE)  # (tokens, V): the student's
      log_p = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_x @ teacher_w / TEMPERATURE))
      kl = lambda log_a, log_b: jnp.sum(jnp.exp(log_a) * (log_a - log_b), -1)
      if divergence == "forward_kl":
        return jnp.mean(kl(log_p, log_q))
      # GKD's generalized JSD: the mixture m = beta p + (1 - beta) q, in log space
      log_m = jnp.logaddexp(log_p + jnp.log(beta), log_q + jnp.log1p(-beta))
      return jnp.mean(beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m))


    def ours(x, w, teacher_x, teacher_w, divergence):
      return jaxact.distillation_loss(
        x, w, teacher_x, teacher_w, divergence=divergence, temperature=TEMPERATURE
      )[0]


    prev = jax.random.randint(jax.random.key(7), (BATCH,), 0, V)
    student = students["forward_kl"]
    args = (hidden(student, prev), student["head"], hidden(teacher, prev), teacher["head"])
    for divergence in ("forward_kl", "jsd"):
      values, grads = {}, {}
      for label, f in (("jaxact", ours), ("plain", plain_distillation)):
        values[label], grads[label] = jax.value_and_grad(f, argnums=(0, 1))(*args, divergence)
      diff = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads["jaxact"], grads["plain"], strict=True)
      )
      print(
        f"{divergence:10s} jaxact {float(values['jaxact']):.7f}  plain "
        f"{float(values['plain']):.7f}  max gradient difference {diff:.1e}"
      )
    """
  ),
  md(
    """
    ## Memory at a real vocabulary

    At a vocabulary of 32768, 1024 tokens, a student of 64 features and a teacher of 256, one
    float32 copy of either model's logits is 128 MiB; the plain composition builds both and keeps
    several for the backward. XLA's compiled memory analysis of `jit(grad)` of the loss in the
    student's `x` and `w` (only compiled, never run) reads the temporary memory each allocates.
    """
  ),
  code(
    """
    TOKENS, BIG_STUDENT_D, BIG_TEACHER_D, BIG_V = 1024, 64, 256, 32768
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    big = (
      f32(TOKENS, BIG_STUDENT_D),
      f32(BIG_STUDENT_D, BIG_V),
      f32(TOKENS, BIG_TEACHER_D),
      f32(BIG_TEACHER_D, BIG_V),
    )
    logits_mib = TOKENS * BIG_V * 4 / 2**20
    for divergence in ("forward_kl", "jsd"):
      temp = {}
      for label, f in (("plain", plain_distillation), ("jaxact", ours)):
        grad = jax.jit(jax.grad(f, argnums=(0, 1)), static_argnums=4)
        compiled = grad.lower(*big, divergence).compile()
        temp[label] = compiled.memory_analysis().temp_size_in_bytes / 2**20
      print(
        f"{divergence:10s} temp: plain {temp['plain']:6.1f} MiB "
        f"({temp['plain'] / logits_mib:.1f} x one logits array), jaxact "
        f"{temp['jaxact']:5.1f} MiB: {temp['jaxact'] / temp['plain']:.3f} x"
      )
    """
  ),
  md(
    """
    jaxact's temporary memory is a few column blocks of both heads, whatever the number of
    tokens; the plain composition's grows with tokens x vocabulary, for each model. The benchmark
    suite measures a real step (8192 tokens, V = 128256): `python -m benchmarks posttrain`.
    """
  ),
]

TRAINER_OPTIONS = [
  md(
    f"""
    # A trainer's options: DPO with its NLL term, GRPO with gradient accumulation

    {colab_badge("05_trainer_options.ipynb")}

    TRL's and Liger-Kernel's trainers set options on their losses that a JAX user porting a
    recipe needs too ([the name tables](https://github.com/{GITHUB_PATH}/blob/main/docs/post-training.md)).
    This notebook trains a tiny autoregressive policy twice, each step checked as it goes:

    - **DPO with RPO's NLL term** (`jaxact.preference_loss(..., rpo_alpha=1.0)`: TRL's `rpo_alpha`,
      Liger's `compute_nll_loss`), against the same loss written on `log_softmax` of the full
      logits;
    - **GRPO with gradient accumulation**: DAPO's token-level loss over micro-batches, each given
      the whole batch's token count (`num_items_in_batch`, as TRL's trainers pass it), so that the
      micro-batches' gradients add up to the whole batch's.

    It runs on a CPU in well under a minute.
    """
  ),
  code(install_cell("optax")),
  code(
    """
    import time

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax

    import jaxact

    print(f"jax {jax.__version__} on {jax.default_backend()}, jaxact {jaxact.__version__}")
    """
  ),
  md(
    """
    ## The policy

    The GRPO notebook's toy: a prompt is one token `s` of a vocabulary of 16, a completion 8
    tokens, and the reward the fraction of them that count up by one from the token before. The
    policy sees the previous token: its embedding, through a residual MLP of
    `jaxact.dense_bias_act` layers, is the final hidden state, and `head` its logits' weights.
    """
  ),
  code(
    """
    V, T, D, HIDDEN = 16, 8, 32, 64  # vocabulary, completion length, features, MLP width


    def init(key):
      k = jax.random.split(key, 4)
      return {
        "embed": jax.random.normal(k[0], (V, D)) * 0.5,
        "w1": jax.random.normal(k[1], (D, HIDDEN)) * D**-0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k[2], (HIDDEN, D)) * HIDDEN**-0.5,
        "b2": jnp.zeros(D),
        "head": jax.random.normal(k[3], (D, V)) * D**-0.5,
      }


    def hidden(params, prev):
      # The final hidden state after each previous token: (...,) -> (..., D).
      h = params["embed"][prev]
      u = jaxact.dense_bias_act(h, params["w1"], params["b1"], activation="gelu")
      return h + jaxact.dense_bias_act(u, params["w2"], params["b2"], activation="tanh")


    def sample(params, prompts, key):
      # One completion per prompt, a token at a time: (n,) -> (n, T).
      def step(prev, k):
        token = jax.random.categorical(k, hidden(params, prev) @ params["head"])
        return token, token

      _, tokens = jax.lax.scan(step, prompts, jax.random.split(key, T))
      return tokens.T


    def previous(prompts, tokens):
      # The token before each completion position: the prompt, then the completion shifted.
      return jnp.concatenate([prompts[:, None], tokens[:, :-1]], axis=1)


    def reward(prompts, tokens):
      return jnp.mean(tokens == (previous(prompts, tokens) + 1) % V, axis=-1)


    def sequence_log_probs(params, prompts, tokens):
      x = hidden(params, previous(prompts, tokens))
      return jaxact.linear_log_probs(x, params["head"], tokens).sum(-1)


    reference = init(jax.random.key(0))  # the initial policy, frozen: DPO's reference
    optimizer = optax.adam(1e-2)
    """
  ),
  md(
    """
    ## DPO with the NLL term

    Each pair: a random prompt, the counting completion as the chosen one and a completion the
    reference samples as the rejected one. The loss is DPO's, `-log sigmoid(beta h)` with `h` the
    chosen completion's log-probability margin over the reference's less the rejected one's, plus
    `rpo_alpha` times the chosen tokens' mean negative log-likelihood (RPO, Pang et al. 2024). The
    reference's sequence log-probabilities are computed once a batch, outside the gradient.
    """
  ),
  code(
    """
    PAIRS, BETA, RPO_ALPHA = 64, 0.1, 1.0


    def dpo_loss(params, prompts, chosen, rejected, ref_chosen, ref_rejected):
      return jaxact.preference_loss(
        hidden(params, previous(prompts, chosen)),
        hidden(params, previous(prompts, rejected)),
        params["head"],
        chosen,
        rejected,
        loss="dpo",
        beta=BETA,
        rpo_alpha=RPO_ALPHA,
        ref_chosen_log_probs=ref_chosen,
        ref_rejected_log_probs=ref_rejected,
      )


    def plain_dpo_loss(params, prompts, chosen, rejected, ref_chosen, ref_rejected):
      # The same loss from the full logits: log_softmax, the tokens' entries, TRL's formula.
      def log_probs(tokens):
        logits = hidden(params, previous(prompts, tokens)) @ params["head"]
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]

      lp_c, lp_r = log_probs(chosen), log_probs(rejected)
      h = (lp_c.sum(-1) - ref_chosen) - (lp_r.sum(-1) - ref_rejected)
      return jnp.mean(-jax.nn.log_sigmoid(BETA * h)) + RPO_ALPHA * -jnp.mean(lp_c)


    @jax.jit
    def pairs(key):
      k_prompts, k_sample = jax.random.split(key)
      prompts = jax.random.randint(k_prompts, (PAIRS,), 0, V)
      chosen = (prompts[:, None] + 1 + jnp.arange(T)) % V
      rejected = sample(reference, prompts, k_sample)
      ref = (sequence_log_probs(reference, prompts, y) for y in (chosen, rejected))
      return (prompts, chosen, rejected, *ref)


    @jax.jit
    def dpo_step(params, opt_state, batch):
      grad_fn = jax.value_and_grad(dpo_loss, has_aux=True)
      (loss, metrics), grads = grad_fn(params, *batch)
      plain, plain_grads = jax.value_and_grad(plain_dpo_loss)(params, *batch)
      diffs = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), grads, plain_grads)
      gap = jnp.max(jnp.stack(jax.tree.leaves(diffs)))
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, metrics, loss - plain, gap


    params, steps = init(jax.random.key(0)), 60
    opt_state = optimizer.init(params)
    dpo = {"loss": [], "nll_loss": [], "rewards/accuracies": []}
    worst = 0.0
    start = time.perf_counter()
    for i in range(steps):
      params, opt_state, loss, metrics, gap_loss, gap_grads = dpo_step(
        params, opt_state, pairs(jax.random.key(200 + i))
      )
      worst = max(worst, abs(float(gap_loss)), float(gap_grads))
      dpo["loss"].append(float(loss))
      for name in ("nll_loss", "rewards/accuracies"):
        dpo[name].append(float(metrics[name]))
    print(f"{steps} DPO steps in {time.perf_counter() - start:.1f} s")
    print(f"largest difference from the full logits' loss and gradients, every step: {worst:.1e}")
    assert worst < 1e-4
    prompts = jnp.arange(4) * 4
    samples = sample(params, prompts, jax.random.key(1))
    print("reward of the trained policy's samples:", np.asarray(reward(prompts, samples)))
    """
  ),
  md(
    """
    ## GRPO with gradient accumulation

    A step samples groups of 8 completions for 16 prompts (128 completions, 1024 tokens) and
    splits them into 4 micro-batches of 32, as a trainer does when one batch does not fit. With
    DAPO's token-level loss each micro-batch's loss is its tokens' sum divided by
    `num_items_in_batch`, the whole batch's token count: the four gradients add up to the whole
    batch's gradient, which the first step checks. Without it each micro-batch would be divided by
    its own count (here the same, but not with masks of different lengths).
    """
  ),
  code(
    """
    PROMPTS, GROUP, MICRO = 16, 8, 4


    @jax.jit
    def rollout(params, key):
      k_prompts, k_sample = jax.random.split(key)
      prompts = jnp.repeat(jax.random.randint(k_prompts, (PROMPTS,), 0, V), GROUP)
      tokens = sample(params, prompts, k_sample)
      rewards = reward(prompts, tokens).reshape(PROMPTS, GROUP)
      mean, std = rewards.mean(1, keepdims=True), rewards.std(1, keepdims=True)
      advantages = ((rewards - mean) / (std + 1e-4)).reshape(-1)
      prev = previous(prompts, tokens)
      old = jaxact.linear_log_probs(hidden(params, prev), params["head"], tokens)
      return (prev, tokens, advantages, old), rewards.mean()


    @jax.jit
    def micro_grad(params, prev, tokens, advantages, old, num_items):
      def loss(params):
        return jaxact.policy_gradient_loss(
          hidden(params, prev),
          params["head"],
          tokens,
          advantages,
          old_log_probs=old,
          loss_type="dapo",
          num_items_in_batch=num_items,
        )[0]

      return jax.grad(loss)(params)


    def accumulated_grad(params, batch):
      num_items = batch[1].size  # every completion token counts (no padding here)
      micro = [jax.tree.map(lambda a, i=i: a[i::MICRO], batch) for i in range(MICRO)]
      grads = [micro_grad(params, *m, num_items) for m in micro]
      return jax.tree.map(lambda *g: sum(g), *grads), num_items


    params = init(jax.random.key(0))
    opt_state = optimizer.init(params)
    batch, _ = rollout(params, jax.random.key(3))
    accumulated, num_items = accumulated_grad(params, batch)
    whole = micro_grad(params, *batch, num_items)
    pairs_of_grads = zip(*map(jax.tree.leaves, (accumulated, whole)), strict=True)
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs_of_grads)
    print(f"4 micro-batches against the whole batch: largest gradient difference {gap:.1e}")
    assert gap < 1e-6

    grpo = []
    start = time.perf_counter()
    for i in range(80):
      batch, mean_reward = rollout(params, jax.random.key(100 + i))
      grads, _ = accumulated_grad(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      grpo.append(float(mean_reward))
    print(f"80 GRPO steps of 4 micro-batches in {time.perf_counter() - start:.1f} s")
    print(f"mean reward: first step {grpo[0]:.3f}, last 10 steps {np.mean(grpo[-10:]):.3f}")
    """
  ),
  code(
    """
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
    axes[0].plot(dpo["loss"], label="DPO + NLL loss")
    axes[0].plot(dpo["nll_loss"], label="its NLL term")
    axes[0].set_title("DPO with rpo_alpha = 1")
    axes[0].legend()
    axes[1].plot(dpo["rewards/accuracies"])
    axes[1].set_title("DPO: pairs whose chosen reward is larger")
    axes[2].plot(grpo)
    axes[2].axhline(1 / V, color="gray", ls=":", label="random policy")
    axes[2].set_title("GRPO (DAPO loss, 4 micro-batches): mean reward")
    axes[2].legend()
    for ax in axes:
      ax.set_xlabel("step")
    fig.tight_layout()
    """
  ),
  md(
    """
    Both losses are computed from the hidden states and the head, never from the
    (tokens, vocabulary) logits (`jaxact.linear_log_probs` underneath); the memory this saves at a
    real vocabulary is measured in the GRPO and distillation notebooks and by
    `python -m benchmarks posttrain`. The tables mapping every TRL and Liger option to jaxact's
    arguments, and saying why where one is not mapped, are in the docs' post-training page.
    """
  ),
]

NOTEBOOKS = {
  "01_quickstart.ipynb": QUICKSTART,
  "02_flax_training.ipynb": FLAX_TRAINING,
  "03_grpo.ipynb": GRPO,
  "04_distillation.ipynb": DISTILLATION,
  "05_trainer_options.ipynb": TRAINER_OPTIONS,
}


def without_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """A copy of `nb` with its code cells' outputs and execution counts cleared."""
  nb = copy.deepcopy(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  return nb


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """`nb` run top to bottom in a kernel of this interpreter, keeping `nb`'s own metadata.

  The kernelspec is written to a temporary folder put first on JUPYTER_PATH (as the tests do), so
  a user's own `python3` kernel from another environment is not picked up. Cell timings and the
  kernel's language_info are not recorded: they would change the file at every build.
  """
  from ipykernel import kernelspec
  from nbclient import NotebookClient

  metadata = copy.deepcopy(nb.metadata)
  with tempfile.TemporaryDirectory() as prefix:
    kernelspec.install(kernel_name="jaxact-build", prefix=prefix)
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
    try:
      client = NotebookClient(
        nb,
        kernel_name="jaxact-build",
        timeout=600,
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
      )
      client.execute()
    finally:
      if old is None:
        del os.environ["JUPYTER_PATH"]
      else:
        os.environ["JUPYTER_PATH"] = old
  nb.metadata = metadata
  return nb


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--no-execute", action="store_true", help="write the cells without outputs")
  parser.add_argument("names", nargs="*", help=f"notebooks to write (default: {list(NOTEBOOKS)})")
  args = parser.parse_args(argv)
  for name in args.names or NOTEBOOKS:
    nb = notebook(NOTEBOOKS[name])
    if not args.no_execute:
      nb = execute(nb)
    nbformat.validate(nb)
    nbformat.write(nb, HERE / name)
    print(f"wrote notebooks/{name}" + ("" if args.no_execute else " (executed)"))


if __name__ == "__main__":
  main()
