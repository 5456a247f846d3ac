"""train.bench.attention on CPU: its default cases, and a peak memory that grows with L where L x L is stored."""

import jax.numpy as jnp

from train.bench import attention as attention_bench


def test_default_cases_span_512_to_4096_at_head_dims_64_and_128_with_one_token_count():
    cases = attention_bench.CASES
    assert {length for _, length, _, _ in cases} == {512, 1024, 2048, 4096}
    assert {head_dim for _, _, _, head_dim in cases} == {64, 128}
    assert len(cases) == 8, "every length at both head_dims"
    assert {batch * length for batch, length, _, _ in cases} == {16384}, "constant tokens: linear memory stays flat"


def test_the_unfused_peak_grows_with_length_at_a_constant_token_count():
    short = attention_bench.run_case((8, 32, 2, 16), on_gpu=False, quick=False)
    long = attention_bench.run_case((1, 256, 2, 16), on_gpu=False, quick=False)
    for result in (short, long):
        xla = result["xla"]
        assert xla["cudnn_workspace_bytes"] is None and xla["kernels"] == []
        assert xla["peak_bytes"] == xla["xla_bytes"] > xla["temp_bytes"] > 0
    # (B, H, L, L) probabilities: 8 x 32^2 against 256^2 elements per head, 8 times as many.
    assert long["xla"]["temp_bytes"] > 4 * short["xla"]["temp_bytes"]


def test_kernel_times_print_each_variants_largest_kernels():
    result = {
        "ffi": {"kernel_ms": {"sdpa_fprop": 0.5, "sdpa_bprop": 1.25, "bias": 0.01}},
        "ffi_dropout": {"kernel_ms": {"sdpa_bprop_dropout": 2.0}},
    }
    lines = attention_bench._format_kernels(result, shown=2).splitlines()
    assert [line.split() for line in lines] == [
        ["ffi", "0.500", "ms", "sdpa_fprop"],
        ["ffi", "1.250", "ms", "sdpa_bprop"],
        ["ffi_dropout", "2.000", "ms", "sdpa_bprop_dropout"],
    ]


def test_form_cases_keep_the_token_count_and_hidden_size():
    for form in attention_bench.FORMS[1:]:
        for length in attention_bench.FORM_LENGTHS:
            batch, _, heads, head_dim = attention_bench.form_shape(form, length)
            assert batch * length == 16384 and heads * head_dim == 1024
    assert attention_bench.form_shape("head_dim_256", 8192) == (2, 8192, 4, 256)
    assert attention_bench.padded_lengths(5, 64).tolist() == [64, 56, 48, 40, 64]


def test_every_form_compares_ls_jax_with_the_same_function_of_dot_product_attention():
    """On CPU both run XLA: ls_jax's op (lengths, causal, cross) and jax.nn.dot_product_attention with the masks the
    benchmark gives its references compute the same values."""
    import jax
    import numpy as np

    from ls_jax import backend

    for form in ("masked", "causal", "cross", "head_dim_128"):
        batch, length, heads, head_dim = 2, 48, 2, {"head_dim_128": 128}.get(form, 16)
        parts = (1, 2) if form == "cross" else (3,)
        sources = tuple(
            attention_bench._normal(seed, (batch, length, p, heads, head_dim), jnp.float32)
            for seed, p in enumerate(parts)
        )
        bias = attention_bench._normal(7, (parts[0], heads, head_dim), jnp.float32)
        variants = attention_bench.form_variants(form, batch, length, on_gpu=True)
        with backend.use("xla"):
            ours = jax.jit(variants["ffi"][1])(sources, bias)
        theirs = jax.jit(variants["xla"][1])(sources, bias)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=form)
    assert set(attention_bench.form_variants("masked", 2, 48, on_gpu=True)) == {
        "ffi",
        "ffi_key_mask",
        "cudnn",
        "cudnn_padded_queries",
        "xla",
    }
    assert set(attention_bench.form_variants("causal", 2, 48, on_gpu=False)) == {"xla"}


def test_a_form_case_on_cpu_runs_xla_and_records_its_form_and_lengths():
    result = attention_bench.run_form_case("masked", 512, on_gpu=False, quick=True, samples=1)
    assert (result["form"], result["batch"], result["length"], result["heads"], result["head_dim"]) == (
        "masked",
        4,
        64,
        16,
        64,
    )
    assert result["key_lengths"] == [64, 56, 48, 40] and set(result) >= {"xla"} and "cudnn" not in result
