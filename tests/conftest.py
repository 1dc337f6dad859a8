"""Test configuration: float64 on (the references and check_grads need it), deterministic inputs.

With x64 enabled, every test builds its arrays with an explicit dtype so that what is under test is
the dtype it names, never a default.
"""

import collections
import os
import sys

# CI's environment sets PYTHONDONTWRITEBYTECODE: every process of the suite (the workers, the
# 8-device scripts, the notebook's kernel, the docs build) would compile jax's and flax's sources
# anew (`import jax, flax.nnx, optax`: 8 s, against 2.5 s from cached bytecode). The first process
# to import a module caches it for the others.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The tests are CPU tests (Pallas kernels in interpret mode, lowering and compiling for abstract
# GPUs). With jax's CUDA plugin loaded (for tests/test_gpu_compile.py), a process that may use CUDA
# makes the plugin look for a driver; on CPU only, it registers just its compiler.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpreter runs each warpgroup as an XLA CPU program whose callbacks block at
# barriers until the other warpgroups arrive, on XLA's CPU thread pool: one thread a core unless
# NPROC says otherwise. On a 2-core machine two waiting warpgroups could hold both threads while
# the third (the one they wait for) never starts: the kernel hangs.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))
# The suite's programs are small: compiling them costs more than running them. LLVM's expensive
# passes off (XLA's HLO passes, fusion and buffer assignment, which the memory tests read, still
# run); here and in every subprocess the tests start (8-device scripts, notebooks, the docs build).
# support.compile_for restores the full backend optimization for the GPU compiles (spill checks).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402 (after the environment above)
import pytest  # noqa: E402

import support  # noqa: E402

jax.config.update("jax_enable_x64", True)
support.use_gpu_compiler()  # before the first computation starts jax's backends


def pytest_make_parametrize_id(config, val, argname):
  """Stable ids for callables (xdist's workers must collect the same names; a default id holds a
  memory address): a function's name, a partial's function and keywords."""
  import functools

  if isinstance(val, functools.partial):
    keywords = ",".join(f"{k}={v}" for k, v in val.keywords.items())
    return f"partial({getattr(val.func, '__name__', type(val.func).__name__)},{keywords})"
  if callable(val) and not isinstance(val, type):
    return getattr(val, "__name__", None) or type(val).__name__
  return None


# The default suite's budget: under 8 minutes on the 2-core CI machine, install included. These
# parametrized tests are surveys: by default each runs `n` of its cases (those not marked exhaustive
# already), spread evenly over its collection order, the first always; 0 runs none. `pytest -m
# exhaustive` runs every case. Chosen from `pytest --durations=0` (2026-11-26); that each
# activation, dtype and option still runs somewhere by default was not checked case by case.
SAMPLED: dict[str, int] = {
  # kernels compiled for GPUs and run in the interpreter
  "tests/test_gpu_compile.py::test_no_spill_where_triton_tiles_spilled_before": 0,
  "tests/test_gpu_compile.py::test_the_fused_backward_keeps_no_dz_in_the_compiled_step": 1,
  "tests/test_gpu_compile.py::test_every_hopper_backward_variant_compiles": 0,
  "tests/test_pallas_hopper.py::test_backward_kernels_over_many_tiles_match_float32_reference": 0,
  "tests/test_pallas_hopper.py::test_every_accepted_activation_lowers_for_h100": 1,
  "tests/test_pallas_hopper.py::test_every_tile_configuration_lowers_for_h100": 1,
  "tests/test_pallas_hopper.py::test_values_and_grads_match_xla": 1,
  "tests/test_pallas_hopper.py::test_expm1_log1p_activations_stay_finite_at_extreme_inputs": 1,
  "tests/test_pallas_hopper.py::test_every_backward_tile_configuration_lowers_for_h100": 1,
  "tests/test_pallas_hopper.py::test_every_backward_tiling_the_benchmark_times_lowers_for_h100": 0,
  "tests/test_pallas_conv.py::test_activations_float32": 1,
  "tests/test_pallas_conv.py::test_layouts_and_shapes": 1,
  "tests/test_pallas_conv.py::test_every_block_config_lowers_for_cuda": 1,
  "tests/test_pallas_conv.py::test_every_spec_activation_lowers_for_cuda": 4,
  "tests/test_pallas.py::test_activations_float32_ragged": 1,
  "tests/test_pallas.py::test_shapes": 2,
  "tests/test_pallas.py::test_half_precision": 1,
  "tests/test_pallas.py::test_every_spec_activation_lowers_for_cuda": 4,
  "tests/test_pallas_lce_hopper.py::test_jaxact_mosaic_equals_the_xla_path": 1,
  "tests/test_pallas_lce_hopper.py::test_forward_kernel_matches_its_reference_and_float64": 1,
  "tests/test_pallas_lce_hopper.py::test_backward_kernel_matches_float64_autodiff": 1,
  "tests/test_pallas_hopper_codes.py::test_forward_writes_the_xla_paths_bytes": 1,
  "tests/test_pallas_attention.py::test_kernels_match_the_reference_and_float64_autodiff": 1,
  "tests/test_pallas_sharding.py::test_sharded_call_lowers_for_h100_to_mosaic_per_shard": 2,
  "tests/test_gpu_codes_section.py::test_epilogue_passes_match_xla_and_count_their_bytes": 0,
  # value and gradient surveys over the spec table
  "tests/test_activations.py::test_values_match_float64_reference_and_jax_nn": 3,
  "tests/test_activations.py::test_gradient_matches_float64_reference": 3,
  "tests/test_activations.py::test_kinks_follow_the_documented_convention": 4,
  "tests/test_activations.py::test_spec_derivatives_match_autodiff_of_reference": 2,
  "tests/test_numerics.py::test_extreme_inputs": 3,
  "tests/test_numerics.py::test_far_inputs_follow_the_asymptote": 3,
  "tests/test_numerics.py::test_nan_propagates": 3,
  "tests/test_numerics.py::test_gradient_at_tiny_inputs_is_that_sides_derivative": 3,
  "tests/test_residuals.py::test_pullback_keeps_what_the_spec_says": 3,
  "tests/test_transforms.py::test_jit_and_vmap": 2,
  "tests/test_transforms.py::test_check_grads_second_order": 2,
  "tests/test_transforms.py::test_checkpoint": 2,
  "tests/test_transforms.py::test_hessian_matches_reference": 2,
  "tests/test_transforms.py::test_scan_over_layers": 1,
  "tests/test_jax_nn_dropin.py::test_nan_gradient_wherever_jax_nn_gives_nan": 3,
  "tests/test_activation_resolution.py::test_jax_nn_function_keeps_what_its_name_keeps": 2,
  "tests/test_sweep.py::test_no_nan_and_gradients_within_a_few_ulps": 2,
  "tests/test_softmax.py::test_axes_match_jax_nn_and_reference": 2,
  "tests/test_params.py::test_gradient_wrt_parameter_and_input": 2,
  "tests/test_errors.py::test_integer_input_behaves_as_jax_nn": 30,
  # fused layers and Flax layers
  "tests/test_fused.py::test_conv_matches_composition": 2,
  "tests/test_fused.py::test_dense_every_activation_by_name": 2,
  "tests/test_fused.py::test_conv_1x1_that_is_not_a_matmul_stays_a_conv": 2,
  "tests/test_fused.py::test_vmap_dense": 2,
  "tests/test_fused.py::test_grad_of_grad_dense": 2,
  "tests/test_fused.py::test_hessian": 1,
  "tests/test_fused.py::test_dense_batch_dims": 2,
  "tests/test_fused.py::test_conv_1x1_takes_the_dense_path": 2,
  "tests/test_fused.py::test_dense_activation_forms": 2,
  "tests/test_fused.py::test_dense_residual": 4,
  "tests/test_fused.py::test_dense_half_precision": 2,
  "tests/test_linen.py::test_conv_options": 3,
  "tests/test_linen.py::test_dense_activations": 5,
  "tests/test_linen.py::test_dense_options": 2,
  "tests/test_linen.py::test_init_is_flax": 2,
  "tests/test_linen.py::test_conv_shapes_and_paddings": 4,
  "tests/test_nnx.py::test_conv_options": 2,
  "tests/test_nnx.py::test_linear_options": 6,
  "tests/test_nnx.py::test_conv_shapes_paddings_dtypes": 3,
  "tests/test_nnx.py::test_linear_activations": 3,
  "tests/test_norm_layers.py::test_linen_equals_flax": 2,
  "tests/test_dropout.py::test_equals_flax_dropout_of_the_plain_layer": 2,
  "tests/test_dropout.py::test_gated_mlp_dropout_is_flax_dropout_of_the_hidden": 1,
  "tests/test_lm_head.py::test_linen_head_is_nn_dense_and_its_loss": 1,
  "tests/test_gated.py::test_float64_matches_autodiff_of_the_composition": 2,
  "tests/test_gated.py::test_lower_precisions_match_the_composition_in_float32": 1,
  "tests/test_lce.py::test_float64_matches_autodiff_of_the_composition": 2,
  "tests/test_lce.py::test_every_block_size_gives_the_same_result": 2,
  "tests/test_sharding.py::test_flax_layers_take_out_sharding_at_the_call": 4,
  "tests/test_codes.py::test_encode_and_pack_match_a_numpy_reference": 2,
  "tests/test_codes.py::test_few_bit_codes_meet_the_optimality_conditions": 1,
  "tests/test_attention_flax.py::test_linen_attention_fn_equals_flax": 1,
  "tests/test_attention_flax.py::test_nnx_attention_fn_equals_flax": 1,
  "tests/test_attention.py::test_float64_values_and_gradients_equal_the_plain_formula": 1,
  "tests/test_attention.py::test_float64_against_jax_nn_xla": 1,
  "tests/test_gpu_compile.py::test_the_conv_epilogue_kernels_do_not_spill": 0,
  "tests/test_gpu_codes_section.py::test_every_timed_function_lowers_for_an_h100": 0,
  "tests/test_activations.py::test_gradient_matches_jax_nn": 4,
  "tests/test_linen.py::test_the_flax_layers_without_flax_name_the_extra_to_install": 0,
  "tests/test_linen.py::test_digits_training_cnn": 0,
  "tests/test_softmax.py::test_where_matches_jax_nn_and_masks_the_gradient": 2,
  "tests/test_softmax.py::test_all_minus_inf_row_is_empty_with_zero_gradient": 2,
  "tests/test_softmax.py::test_stable_for_huge_and_spread_rows": 2,
  "tests/test_params.py::test_numbers_numpy_and_jax_arrays_agree": 2,
  "tests/test_lce.py::test_labels_of_every_integer_dtype_are_their_values": 2,
  "tests/test_lm_check.py::test_jaxact_trains_a_byte_lm_like_the_composition": 1,
  "tests/test_gpu_codes_section.py::test_the_check_passes_for_the_kernels": 0,
  "tests/test_gpu_compile.py::test_the_hopper_kernels_compile_for_an_h100": 0,
  "tests/test_pallas_hopper_codes.py::test_the_coded_kernels_compile_for_h100": 0,
  "tests/test_numerics.py::test_extreme_inputs_rowwise": 3,
  "tests/test_pallas_hopper.py::test_batch_dims_and_no_bias": 0,
  "tests/test_pallas_hopper.py::test_backward_kernels_batch_dims_and_no_bias": 0,
  # the port's own check; the 8-device Gemma decoder of test_sharding runs by default
  "tests/test_sharding.py::test_the_gemma_port_under_the_examples_mesh": 0,
  # the default's mid-cost surveys (durations of 2026-11-26): two or three cases each
  "tests/test_lm_head.py::test_nnx_head_is_nnx_linear_and_its_loss": 2,
  "tests/test_jax_nn_dropin.py::test_array_parameter_promotes_as_in_jax_nn": 2,
  "tests/test_norms.py::test_float64_matches_autodiff": 2,
  "tests/test_numerics.py::test_squareplus_b0_gradient_is_one_for_tiny_positive_x": 2,
  "tests/test_fused.py::test_dense_dtypes": 2,
  "tests/test_lce.py::test_weights_scale_each_token_and_the_mean_divides_by_their_sum": 2,
  "tests/test_norms.py::test_half_precision_against_float32": 2,
  "tests/test_codes.py::test_gradient_is_the_codes": 2,
  "tests/test_jax_nn_dropin.py::test_integer_input_with_jaxact_installed_into_jax_nn": 3,
  "tests/test_jax_nn_dropin.py::test_leaky_relu_gradient_at_minus_zero_is_one": 2,
  "tests/test_activation_resolution.py::test_partials_and_flax_reexports_resolve": 2,
  "tests/test_pallas_conv.py::test_bias_grad_sums_dz_over_every_axis_but_the_last": 2,
  "tests/test_fused.py::test_conv_without_bias": 2,
  "tests/test_codes.py::test_what_the_eight_bit_code_quantizes_is_the_derivative": 2,
  "tests/test_linen.py::test_conv_dtypes": 2,
  "tests/test_numerics.py::test_gelu_gradient_finite_where_jax_nn_is_nan": 2,
  "tests/test_norms.py::test_scale_offset_matches_autodiff_of_the_plain_formula": 2,
  # end-to-end training (nnx's digits run stays; the codes' gradients are tested case by case)
  "tests/test_linen.py::test_digits_training_mlp": 0,
  "tests/test_fewbit_training.py::test_eight_bit_code_tracks_the_exact_residual_on_digits": 0,
  "tests/test_pallas_hopper_codes.py::test_every_code_lowers_for_h100": 0,
  "tests/test_lce.py::test_masked_vocabulary_is_the_smaller_vocabulary": 1,
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Mark the cases SAMPLED leaves out as exhaustive (before `-m` deselects by marks)."""
  groups = collections.defaultdict(list)
  modules = {}
  for item in items:
    modules[item.nodeid.split("::")[0]] = getattr(item, "module", None)
    key = item.nodeid.split("[")[0]
    if key in SAMPLED and not item.get_closest_marker("exhaustive"):
      groups[key].append(item)
  for key in SAMPLED:  # a renamed test must not slip out of the table into the default suite
    path, name = key.split("::")
    if modules.get(path) is not None and not hasattr(modules[path], name):
      raise pytest.UsageError(f"tests/conftest.py SAMPLED names no test: {key}")
  for key, group in groups.items():
    n = SAMPLED[key]
    keep = {round(i * len(group) / n) for i in range(min(n, len(group)))}
    for i, item in enumerate(group):
      if i not in keep:
        item.add_marker(pytest.mark.exhaustive)
