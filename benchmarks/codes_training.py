"""`python -m benchmarks fewbit [--quick] [--seeds N] [--out DIR]`: training with few-bit codes.

Trains three small models with gelu, each from the same initialisation on the same batches, with
the exact residual (`residual_bits=None`: the backward keeps x) and with f'(x) coded in 8, 4 and 2
bits, and compares each coded run with the exact one:

* MLP on scikit-learn's digits (64-256-256-10, `jaxact.linen.DenseAct` with gelu);
* CNN on digits (8x8x1 images: two `jaxact.linen.ConvAct` 3x3 layers, a `DenseAct` head);
* a byte-level decoder-only transformer language model on the English texts of Python's
  `pydoc_data.topics` (2 layers, D=64, context 64), whose MLPs' first layer is
  `jaxact.dense_bias_act(..., activation=partial(jaxact.gelu, residual_bits=b))`.

The noise floor is the exact residual once more on another batch order (same initialisation): a
coded run that stays closer to exact than that differs by less than ordinary run-to-run noise.
The logged loss is the loss on a fixed set of training examples every few steps (the whole digits
training set; fixed windows of the training text), which does not depend on the batch order; the
minibatch loss of every step is compared too. Two seeds (initialisation and batch order) by
default; `--quick` trains fewer steps, one seed. Writes DIR/fewbit.md (tables), DIR/fewbit.json
(the curves) and DIR/fewbit_training.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from pydoc_data.topics import topics

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxact
import jaxact.linen
from benchmarks.harness import plots

BITS = (None, 8, 4, 2)
EXACT, NOISE = "exact", "exact, other batch order"
# Issue 18's targets: 8 bits tracks exact's loss curve at every logged step; 4 bits ends within 1%
# of its loss and half a point of its accuracy.
TARGET_8BIT_CURVE = 0.005
TARGET_4BIT_LOSS = 0.01
TARGET_4BIT_ACC_POINTS = 0.5


def variant_label(bits: int | None) -> str:
  return EXACT if bits is None else f"{bits} bits"


def gelu(bits: int | None) -> Callable:
  return functools.partial(jaxact.gelu, residual_bits=bits)


# ----------------------------------------------------------------------------------------- models


class MLP(nn.Module):
  bits: int | None

  @nn.compact
  def __call__(self, x):
    for features in (256, 256):
      x = jaxact.linen.DenseAct(features, activation=gelu(self.bits))(x)
    return nn.Dense(10)(x)


class CNN(nn.Module):
  bits: int | None

  @nn.compact
  def __call__(self, x):
    x = jaxact.linen.ConvAct(16, (3, 3), activation=gelu(self.bits))(x)
    x = jaxact.linen.ConvAct(32, (3, 3), strides=2, activation=gelu(self.bits))(x)
    x = x.reshape(x.shape[0], -1)
    x = jaxact.linen.DenseAct(64, activation=gelu(self.bits))(x)
    return nn.Dense(10)(x)


LM_LAYERS, LM_WIDTH, LM_HEADS, LM_CONTEXT, LM_VOCAB = 2, 64, 4, 64, 256


def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_init(key) -> dict:
  d = LM_WIDTH
  keys = iter(jax.random.split(key, 3 + 4 * LM_LAYERS))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

  def ln():
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

  blocks = [
    {
      "ln1": ln(),
      "qkv": normal((d, 3 * d), d),
      "proj": normal((d, d), d) / math.sqrt(2 * LM_LAYERS),
      "ln2": ln(),
      "w1": normal((d, 4 * d), d),
      "b1": jnp.zeros(4 * d),
      "w2": normal((4 * d, d), 4 * d) / math.sqrt(2 * LM_LAYERS),
      "b2": jnp.zeros(d),
    }
    for _ in range(LM_LAYERS)
  ]
  return {
    "embed": normal((LM_VOCAB, d), 1) * 0.1,
    "pos": normal((LM_CONTEXT, d), 1) * 0.1,
    "blocks": blocks,
    "ln_f": ln(),
    "head": normal((d, LM_VOCAB), d),
  }


def lm_apply(p: dict, tokens, bits: int | None):
  """Logits (B, T, vocab) of a pre-norm causal transformer over byte tokens (B, T)."""
  b, t = tokens.shape
  d, heads = LM_WIDTH, LM_HEADS
  h = p["embed"][tokens] + p["pos"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for blk in p["blocks"]:
    q, k, v = jnp.split(_layer_norm(h, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
    s = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    h = h + jnp.einsum("bhts,bshd->bthd", s, v).reshape(b, t, d) @ blk["proj"]
    m = _layer_norm(h, blk["ln2"]).reshape(b * t, d)
    u = jaxact.dense_bias_act(m, blk["w1"], blk["b1"], activation=gelu(bits))
    h = h + (u @ blk["w2"] + blk["b2"]).reshape(b, t, d)
  return _layer_norm(h, p["ln_f"]) @ p["head"]


# ------------------------------------------------------------------------------------------ tasks


@dataclasses.dataclass(frozen=True)
class Task:
  """One model and its data. Batches are drawn as indices into `choices` (rows or text offsets)."""

  name: str
  init: Callable  # key -> params
  apply: Callable  # (params, inputs, bits) -> logits (..., classes)
  batch: Callable  # int indices (B,) -> (inputs, integer targets)
  choices: int
  train_eval: tuple  # fixed (inputs, targets): the logged loss and the final train loss
  test: tuple
  batch_size: int
  steps: int
  learning_rate: float
  log_every: int


def _digits():
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return train_test_split(x, y.astype(np.int32), test_size=0.25, random_state=0, stratify=y)


def digits_task(name: str, steps: int) -> Task:
  x_tr, x_te, y_tr, y_te = _digits()
  if name == "MLP":
    module, shape = MLP, (-1, 64)
  else:
    module, shape = CNN, (-1, 8, 8, 1)
  x_tr, x_te = jnp.asarray(x_tr.reshape(shape)), jnp.asarray(x_te.reshape(shape))
  y_tr, y_te = jnp.asarray(y_tr), jnp.asarray(y_te)
  return Task(
    name=f"{name} (digits)",
    init=lambda key: module(None).init(key, x_tr[:1]),
    apply=lambda params, x, bits: module(bits).apply(params, x),
    batch=lambda idx: (x_tr[idx], y_tr[idx]),
    choices=len(y_tr),
    train_eval=(x_tr, y_tr),
    test=(x_te, y_te),
    batch_size=64,
    steps=steps,
    learning_rate=1e-3,
    log_every=10,
  )


def _windows(tokens: np.ndarray, starts: np.ndarray) -> tuple:
  idx = starts[:, None] + np.arange(LM_CONTEXT)
  return jnp.asarray(tokens[idx]), jnp.asarray(tokens[idx + 1])


def lm_task(steps: int, test_windows: int) -> Task:
  # The standard library's documentation topics, in a fixed order; the last tenth is the test text.
  text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
  tokens = np.frombuffer(text, np.uint8).astype(np.int32)
  split = int(0.9 * len(tokens))
  train, test = tokens[:split], tokens[split:]
  choices = len(train) - LM_CONTEXT - 1
  rng = np.random.default_rng(0)
  train_tokens = jnp.asarray(train)

  def batch(starts):
    idx = starts[:, None] + jnp.arange(LM_CONTEXT)
    return train_tokens[idx], train_tokens[idx + 1]

  test_starts = np.arange(test_windows) * ((len(test) - LM_CONTEXT - 1) // test_windows)
  return Task(
    name="transformer LM (pydoc text)",
    init=lm_init,
    apply=lm_apply,
    batch=batch,
    choices=choices,
    train_eval=_windows(train, np.sort(rng.integers(0, choices, 64))),
    test=_windows(test, test_starts),
    batch_size=32,
    steps=steps,
    learning_rate=3e-3,
    log_every=10,
  )


def make_tasks(quick: bool) -> list[Task]:
  if quick:
    return [digits_task("MLP", 100), digits_task("CNN", 60), lm_task(60, 64)]
  return [digits_task("MLP", 400), digits_task("CNN", 300), lm_task(300, 256)]


# --------------------------------------------------------------------------------------- training


def _metrics(logits, targets):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return loss, (logits.argmax(-1) == targets).mean()


@dataclasses.dataclass
class Run:
  label: str
  seed: int
  steps: list[int]  # the logged steps (0: the initialisation)
  logged: list[float]  # loss on the fixed training examples at those steps
  minibatch: list[float]  # every step's minibatch loss (before that step's update)
  train_loss: float
  test_loss: float
  test_accuracy: float
  seconds: float


_PROGRAMS: dict[tuple[str, int | None], Callable] = {}


def _program(task: Task, bits: int | None) -> Callable:
  """The jitted run: (params, batch indices (chunks, log_every, B)) -> (minibatch losses, logged
  losses, test loss, test accuracy). One per task and residual: seeds and batch orders reuse it."""
  if (task.name, bits) in _PROGRAMS:
    return _PROGRAMS[task.name, bits]
  opt = optax.adam(task.learning_rate)

  def loss_fn(p, inputs, targets):
    return _metrics(task.apply(p, inputs, bits), targets)[0]

  def step(state, idx):
    p, o = state
    loss, grads = jax.value_and_grad(loss_fn)(p, *task.batch(idx))
    updates, o = opt.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), loss

  def chunk(state, idx):
    state, losses = jax.lax.scan(step, state, idx)
    return state, (losses, loss_fn(state[0], *task.train_eval))

  @jax.jit
  def run(p, indices):
    first = loss_fn(p, *task.train_eval)
    (p, _), (losses, logged) = jax.lax.scan(chunk, (p, opt.init(p)), indices)
    test_loss, test_acc = _metrics(task.apply(p, task.test[0], bits), task.test[1])
    return losses.reshape(-1), jnp.concatenate([first[None], logged]), test_loss, test_acc

  _PROGRAMS[task.name, bits] = run
  return run


def train(task: Task, bits: int | None, seed: int, order: int) -> Run:
  """One run from the initialisation of `seed`, on the batch order (`seed`, `order`)."""
  started = time.perf_counter()
  params = task.init(jax.random.key(seed))
  chunks = task.steps // task.log_every
  order_key = jax.random.key(10_000 + 100 * seed + order)
  indices = jax.random.randint(
    order_key, (chunks, task.log_every, task.batch_size), 0, task.choices
  )
  minibatch, logged, test_loss, test_acc = _program(task, bits)(params, indices)
  return Run(
    label=NOISE if order else variant_label(bits),
    seed=seed,
    steps=list(range(0, task.steps + 1, task.log_every)),
    logged=[float(v) for v in logged],
    minibatch=[float(v) for v in minibatch],
    train_loss=float(logged[-1]),
    test_loss=float(test_loss),
    test_accuracy=float(test_acc),
    seconds=time.perf_counter() - started,
  )


@dataclasses.dataclass
class Comparison:
  """One run against the exact run of the same seed. Relative differences are fractions."""

  max_rel_logged: float
  max_rel_minibatch: float
  train_loss: float  # signed relative difference of the final loss on the fixed training examples
  test_loss: float  # signed relative difference
  accuracy_points: float  # signed difference of test accuracy, percentage points


def compare(run: Run, exact: Run) -> Comparison:
  def max_rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))

  return Comparison(
    max_rel(run.logged, exact.logged),
    max_rel(run.minibatch, exact.minibatch),
    run.train_loss / exact.train_loss - 1,
    run.test_loss / exact.test_loss - 1,
    100 * (run.test_accuracy - exact.test_accuracy),
  )


def worst(comparisons: list[Comparison]) -> Comparison:
  """Per field, the value of largest magnitude over the seeds."""
  fields = [f.name for f in dataclasses.fields(Comparison)]
  return Comparison(
    *(max((getattr(c, f) for c in comparisons), key=abs) for f in fields)  # type: ignore[arg-type]
  )


# -------------------------------------------------------------------------------------- reporting


@dataclasses.dataclass
class Results:
  quick: bool
  seeds: int
  runs: dict[str, list[Run]]  # task name: every run
  tasks: list[Task]
  seconds: float


def _rows(res: Results, task: Task) -> list[tuple[str, list[Run], Comparison | None]]:
  runs = res.runs[task.name]
  exact = {r.seed: r for r in runs if r.label == EXACT}
  rows = []
  for label in (EXACT, NOISE, *(variant_label(b) for b in BITS if b is not None)):
    mine = [r for r in runs if r.label == label]
    cmp = None if label == EXACT else worst([compare(r, exact[r.seed]) for r in mine])
    rows.append((label, mine, cmp))
  return rows


def _mean(values) -> float:
  values = list(values)
  return sum(values) / len(values)


def table(res: Results) -> list[str]:
  lines = [
    "| model | residual | train loss | test loss | test acc. % | max rel. diff, logged loss | "
    "max rel. diff, minibatch loss | train loss diff | test loss diff | test acc. diff, points |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for task in res.tasks:
    for label, runs, cmp in _rows(res, task):
      cells = [
        f"{_mean(r.train_loss for r in runs):.4f}",
        f"{_mean(r.test_loss for r in runs):.4f}",
        f"{100 * _mean(r.test_accuracy for r in runs):.2f}",
      ]
      if cmp is None:
        cells += ["—"] * 5
      else:
        cells += [
          f"{cmp.max_rel_logged:.2%}",
          f"{cmp.max_rel_minibatch:.2%}",
          f"{cmp.train_loss:+.2%}",
          f"{cmp.test_loss:+.2%}",
          f"{cmp.accuracy_points:+.2f}",
        ]
      lines.append(f"| {task.name} | {label} | " + " | ".join(cells) + " |")
  return lines


def targets(res: Results) -> list[str]:
  """Issue 18's targets, met or not, per model."""
  lines = []
  for task in res.tasks:
    cmp = {label: c for label, _, c in _rows(res, task)}
    c8, c4, noise = cmp["8 bits"], cmp["4 bits"], cmp[NOISE]
    ok8 = c8.max_rel_logged <= TARGET_8BIT_CURVE
    ok4 = (
      abs(c4.train_loss) <= TARGET_4BIT_LOSS
      and abs(c4.test_loss) <= TARGET_4BIT_LOSS
      and abs(c4.accuracy_points) <= TARGET_4BIT_ACC_POINTS
    )
    lines.append(
      f"- {task.name}: 8 bits, logged loss within {TARGET_8BIT_CURVE:.1%} of exact at every "
      f"logged step: {'met' if ok8 else 'not met'} ({c8.max_rel_logged:.2%}; the other batch "
      f"order: {noise.max_rel_logged:.2%}). 4 bits, final train and test loss within "
      f"{TARGET_4BIT_LOSS:.0%} and test accuracy within {TARGET_4BIT_ACC_POINTS} points: "
      f"{'met' if ok4 else 'not met'} ({c4.train_loss:+.2%}, {c4.test_loss:+.2%}, "
      f"{c4.accuracy_points:+.2f} points)."
    )
  return lines


def _machine() -> str:
  dev = jax.devices()[0]
  return (
    f"{platform.machine()}, {os.cpu_count()} cores, {dev.device_kind} ({dev.platform}); "
    f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
    f"flax {flax.__version__}, optax {optax.__version__}, jaxact {jaxact.__version__}"
  )


def render(res: Results, figure: str) -> str:
  setups = [
    f"- {t.name}: {t.steps} steps of adam (learning rate {t.learning_rate}), batch "
    f"{t.batch_size}, loss logged every {t.log_every} steps; {t.test[1].size} test predictions "
    f"(one is {100 / t.test[1].size:.3f} accuracy points)"
    for t in res.tasks
  ]
  lines = [
    "# Few-bit derivative codes: training parity",
    "",
    f"- date: {datetime.date.today().isoformat()}",
    f"- machine: {_machine()}",
    f"- command: `python -m benchmarks fewbit{' --quick' if res.quick else ''}"
    f"{f' --seeds {res.seeds}' if res.seeds != (1 if res.quick else 2) else ''}`",
    f"- run time: {res.seconds:.0f} s; seeds: {res.seeds} (initialisation and batch order)",
    *setups,
    "",
    "Each coded run starts from the exact run's initialisation and sees its batches. Loss and",
    "accuracy columns: the mean over seeds; difference columns: against the exact run of the same",
    "seed, the largest over seeds. The logged loss is on fixed training examples (the digits",
    "training set; 64 fixed windows of the training text); the minibatch loss is every step's.",
    "The figure shows seed 0.",
    "",
    *table(res),
    "",
    "Targets (issue 18):",
    "",
    *targets(res),
    "",
    f"![{figure}]({figure})",
    "",
  ]
  return "\n".join(lines)


def write_figure(res: Results, path: pathlib.Path) -> None:
  curves = {}
  for task in res.tasks:
    by_label = {}
    for r in res.runs[task.name]:
      if r.seed == 0:
        by_label[r.label] = (r.steps, r.logged)
    curves[task.name] = by_label
  plots.fewbit_training(curves, EXACT, TARGET_8BIT_CURVE, path)


def measure(quick: bool, seeds: int) -> Results:
  started = time.perf_counter()
  tasks = make_tasks(quick)
  runs: dict[str, list[Run]] = {}
  for task in tasks:
    runs[task.name] = []
    for seed in range(seeds):
      for bits, order in [(None, 0), (None, 1), *((b, 0) for b in BITS if b is not None)]:
        run = train(task, bits, seed, order)
        runs[task.name].append(run)
        print(
          f"{task.name}, seed {seed}, {run.label}: train loss {run.train_loss:.4f}, "
          f"test loss {run.test_loss:.4f}, test acc. {run.test_accuracy:.2%} ({run.seconds:.1f} s)",
          file=sys.stderr,
        )
  return Results(quick, seeds, runs, tasks, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks fewbit", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--quick", action="store_true", help="fewer steps, one seed")
  parser.add_argument(
    "--seeds", type=int, default=None, help="initialisations and batch orders (2; --quick: 1)"
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder"
  )
  args = parser.parse_args(argv)
  seeds = args.seeds or (1 if args.quick else 2)
  res = measure(args.quick, seeds)
  args.out.mkdir(parents=True, exist_ok=True)
  figure = "fewbit_training.png"
  write_figure(res, args.out / figure)
  (args.out / "fewbit.md").write_text(render(res, figure))
  raw = {name: [dataclasses.asdict(r) for r in runs] for name, runs in res.runs.items()}
  (args.out / "fewbit.json").write_text(json.dumps(raw))
  print("\n".join([*table(res), "", *targets(res)]))
  print(f"\n{args.out / 'fewbit.md'}, {args.out / figure} ({res.seconds:.0f} s)", file=sys.stderr)
  return 0
