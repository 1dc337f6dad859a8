"""The public surface: jax.nn's names, signatures and aliases; docstrings and their doctests."""

from __future__ import annotations

import ast
import doctest
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.core.spec import ALIASES, SPECS

from cases import jax_nn, public

ALL = [pytest.param(s, id=s.name) for s in SPECS]


@pytest.mark.parametrize("spec", ALL)
def test_public_function_exists_and_is_found_by_name(spec):
  f = public(spec)
  assert f.__name__ == spec.name
  assert jaxact.get_activation(spec.name) is f
  assert jaxact.get_spec(spec.name) is spec
  assert spec.name in jaxact.__all__


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in SPECS if s.jax_nn])
def test_signature_matches_jax_nn(spec):
  """jax.nn's parameters, in order and with their defaults; jaxact adds only the keyword-only
  ``residual_bits`` of the input-residual activations (tests/codes/test_codes.py)."""
  ours = dict(inspect.signature(public(spec)).parameters)
  theirs = inspect.signature(jax_nn(spec)).parameters
  extra = ours.pop("residual_bits", None)
  assert extra is None or extra.kind is inspect.Parameter.KEYWORD_ONLY
  assert list(ours) == list(theirs)
  for name, p in theirs.items():
    assert ours[name].default == p.default, f"{spec.name}({name}=...) default differs"
    assert (ours[name].default is inspect.Parameter.empty) == (p.default is inspect.Parameter.empty)


def test_aliases():
  assert jaxact.swish is jaxact.silu
  assert jaxact.hard_swish is jaxact.hard_silu
  assert ALIASES == {"swish": "silu", "hard_swish": "hard_silu"}
  for alias, name in ALIASES.items():
    assert getattr(jaxact, alias) is getattr(jaxact, name)
    assert jaxact.get_activation(alias) is getattr(jaxact, name)
    assert jaxact.get_spec(alias) is jaxact.get_spec(name)
    assert alias in jaxact.__all__
    assert getattr(jax.nn, alias) is getattr(jax.nn, name)  # the same pairs as jax.nn's


def test_all_names_exist():
  for name in jaxact.__all__:
    assert hasattr(jaxact, name), name
  assert tuple(s.name for s in SPECS) == jaxact.ACTIVATIONS


@pytest.mark.parametrize("spec", ALL)
def test_docstring_states_formula_residual_and_kinks(spec):
  doc = public(spec).__doc__
  assert doc.splitlines()[0] == spec.summary
  assert spec.formula in doc
  residual = {"output": "the output", "input": "the input", "none": "nothing"}[spec.residual]
  assert f"Saved residual: {residual}" in doc
  for x0 in spec.kinks:
    assert f"f'({x0:g})" in doc, f"kink at {x0} not documented"
  for p in spec.params:
    assert f"  {p.name}: " in doc, f"parameter {p.name} not documented"


def _examples(spec):
  doc = public(spec).__doc__
  return doctest.DocTestParser().get_examples(doc)


@pytest.mark.parametrize("spec", ALL)
def test_docstring_example_runs_and_is_right(spec):
  """Run each docstring's doctest; compare printed numbers to 1e-4 (they are written to 4
  decimals), and check them against jax.nn where it has the function. (pytest's --doctest-modules
  runs these too, with its NUMBER flag; this test does not depend on that flag or on x64.)"""
  examples = _examples(spec)
  assert examples, f"jaxact.{spec.name} has no doctest"
  namespace = {}
  checked = 0
  for ex in examples:
    code = compile(ex.source, f"<jaxact.{spec.name} docstring>", "eval" if ex.want else "exec")
    if not ex.want:
      exec(code, namespace)
      continue
    got = eval(code, namespace)
    want = ast.literal_eval(ex.want.strip())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)
    checked += 1
  assert checked, f"jaxact.{spec.name}'s doctest prints nothing to check"
  x_src, printed = spec.example
  assert printed.strip() in examples[-1].want.strip()
  if spec.jax_nn:  # spec.example's numbers are "taken from jax.nn"
    x = eval(x_src, {"jnp": jnp})
    want = getattr(jax.nn, spec.name)(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(ast.literal_eval(printed)), want, atol=1e-4, rtol=0)
