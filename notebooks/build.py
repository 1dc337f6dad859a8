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

NOTEBOOKS = {"01_quickstart.ipynb": QUICKSTART, "02_flax_training.ipynb": FLAX_TRAINING}


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
