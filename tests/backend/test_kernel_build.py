"""CPU: the CUDA kernel library builds and exports its targets, the build reports errors clearly, the CUDA Philox
is bit-identical to ls_jax.ops.random, and every op's FFI implementation lowers (for CUDA) to its kernels.

Building needs nvcc but no GPU; tests that compile skip, saying so, where nvcc is absent.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import normal, seed_array

import ffi_kernels
from ffi_kernels import build
from ls_jax import backend, ops
from ls_jax.ops import random

REPO = Path(__file__).resolve().parents[2]

# The targets the dropout, LayerNorm and embedding kernels provide (other files add their own).
EXPECTED_TARGETS = {
    "ls_dropout",
    "ls_bias_dropout_residual_fwd",
    "ls_bias_dropout_residual_bwd",
    "ls_bias_act_dropout_fwd",
    "ls_bias_act_dropout_bwd",
    "ls_bias_relu_dropout_fwd",
    "ls_bias_relu_dropout_bwd",
    "ls_layer_norm_fwd",
    "ls_layer_norm_add_fwd",
    "ls_layer_norm_bwd",
    "ls_layer_norm_add_bwd",
    "ls_bias_dropout_residual_layer_norm_fwd",
    "ls_bias_dropout_residual_layer_norm_bwd",
    "ls_embed_fwd",
    "ls_embed_pos_fwd",
    "ls_embed_grad",
}


def _require_nvcc() -> Path:
    try:
        return build.find_nvcc()
    except ffi_kernels.NvccNotFoundError as err:
        pytest.skip(f"nvcc is not installed here: {err}")


def _declared_targets(with_cudnn: bool = True) -> set[str]:
    """Every target a csrc/*.cu file registers (without ``build.CUDNN_SOURCES``' unless ``with_cudnn``)."""
    pattern = re.compile(r"LS_(?:FFI|REGISTER|REGISTER_STAGED)_TARGET\(\s*(ls_\w+)")
    kernels = [path for path in build.sources(with_cudnn) if path.suffix == ".cu"]
    return {name for path in kernels for name in pattern.findall(path.read_text())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The library for sm_80, the oldest architecture it supports (every GPU run builds it for its own GPU)."""
    _require_nvcc()
    return build.build(("sm_80",), cache_dir=tmp_path_factory.mktemp("kernel-cache"))


@pytest.mark.slow
def test_library_builds_for_sm80_and_exports_every_target(built):
    assert built.archs == ("sm_80",) and not built.cached and built.path.is_file()
    assert EXPECTED_TARGETS <= _declared_targets()
    capsules = ffi_kernels.import_library(built.path).targets()
    assert {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"} <= _declared_targets()
    assert set(capsules) == _declared_targets(with_cudnn=built.cudnn_missing is None)
    staged = {name: handlers for name, handlers in capsules.items() if isinstance(handlers, dict)}
    assert set(staged) == (
        {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"} if built.cudnn_missing is None else set()
    ), "cuDNN attention builds its graphs in the initialize stage"
    stage_capsules = [capsule for handlers in staged.values() for capsule in handlers.values()]
    assert all(set(handlers) == {"initialize", "execute"} for handlers in staged.values())
    plain = [capsule for name, capsule in capsules.items() if name not in staged]
    assert {type(capsule).__name__ for capsule in plain + stage_capsules} == {"PyCapsule"}
    nm = subprocess.run(["nm", "-D", "--defined-only", str(built.path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert set(capsules) <= exported


@pytest.mark.slow
def test_second_build_of_the_same_sources_is_cached(built):
    again = build.build(("sm_80", "sm_80"), cache_dir=built.path.parents[1])
    assert again.cached and again.path == built.path and again.archs == ("sm_80",)
    nvcc = build.find_nvcc()
    assert build.cache_key(nvcc, ("sm_80", "sm_90"), "") != build.cache_key(nvcc, ("sm_80",), "")


def test_each_architecture_gets_machine_code_and_the_newest_also_ptx():
    gencode = [flag for flag in build.compile_flags(("sm_80", "sm_90")) if flag.startswith("-gencode")]
    assert gencode == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_build_cli_help():
    process = subprocess.run(
        [sys.executable, "-m", "ffi_kernels.build", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 0, process.stderr
    assert "--arch" in process.stdout and "--force" in process.stdout and "LS_JAX_CACHE" in process.stdout


def test_architectures_are_validated():
    with pytest.raises(ValueError, match="sm_90"):
        build.validate_archs(["90"])
    assert build.validate_archs(["sm_90", "sm_80", "sm_90", "sm_90a"]) == ("sm_80", "sm_90", "sm_90a")


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(build, "_DEFAULT_CUDA_HOME", tmp_path)
    with pytest.raises(ffi_kernels.NvccNotFoundError, match="CUDA_HOME"):
        build.build(cache_dir=tmp_path)


def test_compile_error_carries_the_compiler_output(monkeypatch, tmp_path):
    _require_nvcc()
    sources = tmp_path / "csrc"
    sources.mkdir()
    for name in ("registry.h", "common.cuh", "module.cc"):
        shutil.copy(build.CSRC / name, sources / name)
    (sources / "broken.cu").write_text('#include "common.cuh"\nint broken() { return undeclared_name; }\n')
    monkeypatch.setattr(build, "CSRC", sources)
    with pytest.raises(ffi_kernels.KernelBuildError, match="(?s)broken.cu.*undeclared_name"):
        build.build(("sm_90",), cache_dir=tmp_path / "cache")


_PHILOX_PROGRAM = r"""
#include <cstdio>
#include "common.cuh"

int main() {
  unsigned c0, c1, c2, c3, k0, k1;
  while (std::scanf("%u %u %u %u %u %u", &c0, &c1, &c2, &c3, &k0, &k1) == 6) {
    const uint4 w = ls::philox4x32_10(make_uint4(c0, c1, c2, c3), make_uint2(k0, k1));
    std::printf("%u %u %u %u\n", w.x, w.y, w.z, w.w);
  }
  return 0;
}
"""


def _run_host_program(tmp_path, program: str, stdin: str) -> str:
    """Compiles a host-only program against common.cuh with nvcc, runs it on ``stdin`` and returns its stdout."""
    nvcc = _require_nvcc()
    source = tmp_path / "program.cu"
    source.write_text(program)
    binary = tmp_path / "program"
    subprocess.run(
        [
            str(nvcc),
            "-std=c++17",
            "-I",
            str(build.CSRC),
            "-isystem",
            jax.ffi.include_dir(),
            str(source),
            "-o",
            str(binary),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True).stdout


def test_cuda_philox_is_bit_identical_to_random_py(tmp_path):
    words = np.random.default_rng(0).integers(0, 2**32, size=(256, 6), dtype=np.uint64)
    words[:4] = [[0, 0, 0, 0, 0, 0], [2**32 - 1] * 6, [1, 0, 0, 0, 7, 9], [2**31, 0, 0, 0, 2**32 - 1, 0]]
    stdin = "\n".join(" ".join(map(str, row)) for row in words.tolist()) + "\n"
    output = _run_host_program(tmp_path, _PHILOX_PROGRAM, stdin)
    cuda = np.array([line.split() for line in output.splitlines()], np.uint64)
    counter = tuple(jnp.asarray(words[:, i], jnp.uint32) for i in range(4))
    key = (jnp.asarray(words[:, 4], jnp.uint32), jnp.asarray(words[:, 5], jnp.uint32))
    expected = np.stack([np.asarray(w) for w in random.philox4x32(counter, key)], axis=-1).astype(np.uint64)
    np.testing.assert_array_equal(cuda, expected)


_DRAW_PROGRAM = r"""
#include <cstdio>
#include "common.cuh"

int main() {
  unsigned k0, k1, count;
  if (std::scanf("%u %u %u", &k0, &k1, &count) != 3) return 1;
  for (unsigned i = 0; i < count; ++i) std::printf("%u\n", ls::dropout_draw(make_uint2(k0, k1), i));
  return 0;
}
"""


def test_cuda_dropout_draws_are_bit_identical_to_random_py(tmp_path):
    """The element -> 16-bit draw layout (which call, word and half) is the one random.py documents."""
    seed = (0x12345678, 0x9ABCDEF0)
    count = 203
    output = _run_host_program(tmp_path, _DRAW_PROGRAM, f"{seed[0]} {seed[1]} {count}\n")
    cuda = np.array(output.split(), np.uint32)
    expected = np.asarray(random.random_draws(jnp.array(seed, jnp.uint32), (count,)))
    np.testing.assert_array_equal(cuda, expected)


# ---- the FFI implementations lower to their kernels ------------------------------------------------------


@pytest.fixture
def kernels_enabled(monkeypatch):
    """Ops dispatch to the kernels; lowering for CUDA then needs no GPU (nothing is compiled or run)."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    monkeypatch.setattr(ffi_kernels, "sm_count", lambda: 132)


def _cuda_module(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _forward_and_backward(op, *primals):
    outputs, vjp = jax.vjp(op, *primals)
    return outputs, vjp(jax.tree.map(jnp.ones_like, outputs))


def _targets(text: str) -> set[str]:
    return set(re.findall(r"custom_call @(ls_\w+)", text))


def test_dropout_ops_lower_to_their_kernels_with_the_xla_mask_attributes(kernels_enabled):
    x, bias, seed = normal(0, (4, 8), jnp.bfloat16), normal(1, (8,), jnp.float32), seed_array(0)
    text = _cuda_module(lambda x, s: _forward_and_backward(lambda x: ops.dropout(x, rate=0.1, seed=s), x), x, seed)
    assert _targets(text) == {"ls_dropout"}
    assert f"threshold = {random.keep_threshold(0.1)} : ui32" in text
    assert re.search(r"scale = 1.1111111\d* : f32", text)
    bdr = lambda x, b, r: ops.bias_dropout_residual(x, b, r, dropout_rate=0.1, seed=seed)
    assert _targets(_cuda_module(lambda *p: _forward_and_backward(bdr, *p), x, bias, x)) == {
        "ls_bias_dropout_residual_fwd",
        "ls_bias_dropout_residual_bwd",
    }
    for index, activation in enumerate(ops.ACTIVATIONS):
        bad = lambda x, b: ops.bias_act_dropout(x, b, activation=activation)
        text = _cuda_module(lambda *p: _forward_and_backward(bad, *p), x, bias)
        if activation == "relu":
            assert _targets(text) == {"ls_bias_relu_dropout_fwd", "ls_bias_relu_dropout_bwd"}
            assert "tensor<4x1xui8>" in text, "the forward returns one bit per element, 8 to a byte"
            assert "threshold = 0 : ui32" in text
        else:
            assert _targets(text) == {"ls_bias_act_dropout_fwd", "ls_bias_act_dropout_bwd"}
            assert f"activation = {index} : i32" in text and "threshold = 0 : ui32" in text


def test_layer_norm_lowers_to_its_kernels_below_the_hidden_limit(kernels_enabled):
    gamma = jnp.ones((8192,), jnp.float32)
    x = normal(0, (300, 8192), jnp.bfloat16)
    plain = lambda x, g, b: _forward_and_backward(lambda x, g, b: ops.layer_norm(x, g, b), x, g, b)
    assert _targets(_cuda_module(plain, x, gamma, gamma)) == {"ls_layer_norm_fwd", "ls_layer_norm_bwd"}
    add = lambda x, g, b: _forward_and_backward(lambda x, r, g, b: ops.layer_norm(x, g, b, residual=r), x, x, g, b)
    text = _cuda_module(add, normal(2, (2000, 8192), jnp.bfloat16), gamma, gamma)
    assert _targets(text) == {"ls_layer_norm_add_fwd", "ls_layer_norm_add_bwd"}
    assert re.search(r"tensor<1056x2x8192xf32>", text), "backward scratch: at most 8 partial rows per SM"
    wide = jnp.ones((8193,), jnp.float32)
    assert _targets(_cuda_module(plain, normal(1, (2, 8193), jnp.float32), wide, wide)) == set()


def test_bias_dropout_residual_layer_norm_lowers_to_one_kernel_each_way(kernels_enabled):
    seed = seed_array(0)

    x, gamma = normal(0, (300, 8192), jnp.bfloat16), jnp.ones((8192,), jnp.float32)
    fused = lambda x, b, r, g, be: ops.layer_norm(x, g, be, residual=r, bias=b, dropout_rate=0.1, seed=seed)
    text = _cuda_module(lambda *p: _forward_and_backward(fused, *p), x, gamma, x, gamma, gamma)
    assert _targets(text) == {"ls_bias_dropout_residual_layer_norm_fwd", "ls_bias_dropout_residual_layer_norm_bwd"}
    assert re.search(r"tensor<300x3x8192xf32>", text), "backward scratch: dgamma, dbeta, dbias; a row per row"
    assert f"threshold = {random.keep_threshold(0.1)} : ui32" in text


def test_embedding_lowers_to_its_kernels(kernels_enabled):
    tokens = jnp.array([[1, 2, 0], [3, 3, 9]], jnp.int32)
    table, pos_table = normal(0, (10, 16), jnp.float32), normal(1, (5, 16), jnp.float32)
    embed = lambda t, p: ops.embed(tokens, t, p, padding_id=0, dropout_rate=0.1, seed=seed_array(0), dtype=jnp.bfloat16)
    text = _cuda_module(lambda t, p: _forward_and_backward(embed, t, p), table, pos_table)
    assert _targets(text) == {"ls_embed_pos_fwd", "ls_embed_grad"}
    assert "has_padding = true" in text and "padding_id = 0 : i64" in text
    no_positions = lambda t: _forward_and_backward(lambda t: ops.embed(tokens, t, scale=4.0), t)
    text = _cuda_module(no_positions, table)
    assert _targets(text) == {"ls_embed_fwd", "ls_embed_grad"} and "token_scale = 4.000000e+00 : f32" in text


def test_attention_lowers_to_its_kernels_for_the_shapes_they_take(kernels_enabled, monkeypatch):
    monkeypatch.setattr(ops.attention_cudnn, "missing", lambda: "built without cuDNN attention")
    qkv, mask = normal(0, (2, 64, 3, 4, 64), jnp.bfloat16), jnp.ones((2, 64), bool)
    self_attention = lambda x: ops.self_attention(x, mask, causal=True, dropout_rate=0.1, seed=seed_array(0))
    text = _cuda_module(lambda x: _forward_and_backward(self_attention, x), qkv)
    assert _targets(text) == {"ls_attention_fwd", "ls_attention_bwd"}
    assert "causal = true" in text and f"threshold = {random.keep_threshold(0.1)} : ui32" in text
    assert re.search(r"logit_scale = 1.250000e-01 : f32", text)
    assert "tensor<2x4x64x8xui8>" in text, "the forward hands the backward its keep mask, 8 keys to a byte"
    query, key_value = normal(1, (2, 5, 4, 64), jnp.float16), normal(2, (2, 128, 2, 4, 64), jnp.float16)
    cross = lambda q, kv: _forward_and_backward(lambda q, kv: ops.cross_attention(q, kv), q, kv)
    text = _cuda_module(cross, query, key_value)
    assert _targets(text) == {"ls_attention_fwd", "ls_attention_bwd"}
    assert "tensor<0xui8>" in text, "without dropout there is no keep mask"
    too_long = normal(3, (2, 129, 2, 4, 64), jnp.float16)
    assert _targets(_cuda_module(cross, query, too_long)) == {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}
    monkeypatch.setattr(ops.attention_cudnn, "missing", lambda: None)
    monkeypatch.delenv(ops.attention.CUDNN_ENV_VAR, raising=False)
    retraced = lambda q, kv: cross(q, kv)  # the kernel choice is made when tracing
    assert _targets(_cuda_module(retraced, query, too_long)) == {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"}
    monkeypatch.setenv(ops.attention.CUDNN_ENV_VAR, "0")
    retraced_again = lambda q, kv: cross(q, kv)
    assert _targets(_cuda_module(retraced_again, query, too_long)) == {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}


def test_cross_entropy_backward_lowers_in_place_over_the_logits(kernels_enabled):
    logits, labels = normal(0, (6, 1001), jnp.bfloat16), jnp.array([3, 1, 0, 1000, 1, 7], jnp.int32)
    criterion = lambda z: ops.label_smoothed_cross_entropy(z, labels, epsilon=0.1, pad_id=1)[:2]
    text = _cuda_module(lambda z: _forward_and_backward(criterion, z), logits)
    assert _targets(text) == {"ls_cross_entropy_fwd", "ls_cross_entropy_bwd"}
    [backward] = [line for line in text.splitlines() if "custom_call @ls_cross_entropy_bwd" in line]
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2," in backward, backward
