"""train.bench.attention on CPU: its default cases, and a peak memory that grows with L where L x L is stored."""

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
    result = {"ffi": {"kernel_ms": {"sdpa_fprop": 0.5, "sdpa_bprop": 1.25, "bias": 0.01}},
              "ffi_dropout": {"kernel_ms": {"sdpa_bprop_dropout": 2.0}}}
    lines = attention_bench._format_kernels(result, shown=2).splitlines()
    assert [line.split() for line in lines] == [["ffi", "0.500", "ms", "sdpa_fprop"],
                                                ["ffi", "1.250", "ms", "sdpa_bprop"],
                                                ["ffi_dropout", "2.000", "ms", "sdpa_bprop_dropout"]]
