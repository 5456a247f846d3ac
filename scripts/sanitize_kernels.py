"""Runs every CUDA kernel of ls_jax once, forward and backward, for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/sanitize_kernels.py [SUBSTRING...]

Small shapes that reach each kernel's edge cases (odd hidden sizes, a partial last vector, short and long keys,
fully masked rows, padding ids, 16-bit storage, cuDNN's attention beyond 128 positions) in one process, so the
sanitizer attaches once. It fails when any FFI target of the library went unexercised, so a clean run covers them
all. With SUBSTRINGs it runs only the
cases whose names contain one (e.g. to look at one case alone) and does not check that coverage.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import ls_jax.optim
from ls_jax import backend, ops

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def normal(key: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


Case = tuple[Callable[..., Any], tuple[jax.Array, ...]]  # a jitted function and its arguments


def forward_backward(op: Callable[..., Any], *primals: jax.Array) -> Case:
    """``op(*primals)`` and the gradient of the sum of its floating outputs, jitted."""

    def loss(*args):
        outputs = op(*args)
        return sum(
            jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)
        )

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(primals))))), primals


def cases(dtype: Any) -> dict[str, Case]:
    seed = jnp.array([7, 11], jnp.uint32)
    hidden = 1001  # odd: the vector loop and the scalar tail both run
    history = jnp.linspace(0.0, 2.0, 1000, dtype=jnp.float32)  # an FP8 amax history, not a multiple of the block
    x, r = normal(1, (5, hidden), dtype), normal(2, (5, hidden), dtype)
    gamma, beta, bias = normal(3, (hidden,), dtype), normal(4, (hidden,), dtype), normal(5, (hidden,), dtype)
    mask = jnp.arange(37)[None, None, None, :] < jnp.array([37, 0])[:, None, None, None]  # batch 1 fully masked
    key_mask = jnp.arange(7)[None, :] < jnp.array([7, 0])[:, None]
    long_mask = jnp.arange(301)[None, :] < jnp.array([250, 0])[:, None]
    scattered_mask = jax.random.bernoulli(jax.random.PRNGKey(24), 0.7, (2, 1037))
    tokens = jnp.array([[3, 0, 9, 100], [1, 2, 0, 0]], jnp.int32)
    labels = jnp.array([[1, 0, 1002], [5, 0, 0]], jnp.int32)
    return {
        "layer_norm": forward_backward(lambda x, g, b: ops.layer_norm(x, g, b), x, gamma, beta),
        "layer_norm+residual": forward_backward(
            lambda x, r, g, b: ops.layer_norm(x, g, b, residual=r), x, r, gamma, beta
        ),
        **{
            f"bias_dropout_residual+layer_norm[{h}]": forward_backward(
                lambda x, b, r, g, be: ops.layer_norm(x, g, be, residual=r, bias=b, dropout_rate=0.1, seed=seed),
                x[:, :h],
                bias[:h],
                r[:, :h],
                gamma[:h],
                beta[:h],
            )
            for h in (hidden, 1000)
        },
        "dropout": forward_backward(lambda x: ops.dropout(x, rate=0.1, seed=seed), x),
        "bias_dropout_residual": forward_backward(
            lambda x, b, r: ops.bias_dropout_residual(x, b, r, dropout_rate=0.1, seed=seed), x, bias, r
        ),
        **{
            f"bias_act_dropout[{act}]": forward_backward(
                lambda x, b, act=act: ops.bias_act_dropout(x, b, activation=act, dropout_rate=0.1, seed=seed), x, bias
            )
            for act in ("relu", "gelu", "gelu_tanh")
        },
        "attn_softmax[short keys, padding]": forward_backward(
            lambda s: ops.attn_softmax(s, mask, scale=0.125, dropout_rate=0.1, seed=seed),
            normal(6, (2, 3, 5, 37), dtype),
        ),
        "attn_softmax[long keys, causal]": forward_backward(
            lambda s: ops.attn_softmax(s, causal=True, scale=0.125, dropout_rate=0.1, seed=seed),
            normal(7, (1, 2, 3, 4100), dtype),
        ),
        # bf16/f16 reach the fused attention kernels (both register sizes); f32 runs the attn_softmax kernels.
        "self_attention[7 positions, causal, padding, bias]": forward_backward(
            lambda qkv, b: ops.self_attention(qkv, key_mask, bias=b, causal=True, dropout_rate=0.1, seed=seed),
            normal(14, (2, 7, 3, 2, 64), dtype),
            normal(18, (3, 2, 64), jnp.float32),
        ),
        "self_attention[100 positions, 192 heads: blocks loop over heads]": forward_backward(
            lambda qkv: ops.self_attention(qkv, dropout_rate=0.1, seed=seed), normal(15, (3, 100, 3, 64, 64), dtype)
        ),
        "cross_attention[128 queries, 40 keys, bias]": forward_backward(
            lambda q, kv, b: ops.cross_attention(q, kv, bias=b, dropout_rate=0.1, seed=seed),
            normal(16, (1, 128, 2, 64), dtype),
            normal(17, (1, 40, 2, 2, 64), dtype),
            normal(19, (2, 64), jnp.float32),
        ),
        # Beyond the fused kernels' 128 positions bf16/f16 run cuDNN's flash attention (its workspace from the
        # library's pool), f32 the attn_softmax kernels.
        "self_attention[cuDNN: 301 positions, causal, padding with a row all padding, dropout, bias]": forward_backward(
            lambda qkv, b: ops.self_attention(qkv, long_mask, bias=b, causal=True, dropout_rate=0.1, seed=seed),
            normal(20, (2, 301, 3, 2, 64), dtype),
            normal(21, (3, 2, 64), jnp.float32),
        ),
        "self_attention[cuDNN: 301 positions, key lengths with a row of length 0, no bias tensor]": forward_backward(
            lambda qkv: ops.self_attention(qkv, lengths=jnp.array([250, 0]), dropout_rate=0.1, seed=seed),
            normal(24, (2, 301, 3, 2, 64), dtype),
        ),
        "cross_attention[cuDNN: 131 queries, 1037 keys, head_dim 128, scattered mask, dropout]": forward_backward(
            lambda q, kv: ops.cross_attention(q, kv, scattered_mask, dropout_rate=0.1, seed=seed),
            normal(22, (2, 131, 2, 128), dtype),
            normal(23, (2, 1037, 2, 2, 128), dtype),
        ),
        "embed[learned positions]": forward_backward(
            lambda t, p: ops.embed(tokens, t, p, scale=2.0, padding_id=0, dropout_rate=0.1, seed=seed),
            normal(8, (101, 72), dtype),
            normal(9, (6, 72), dtype),
        ),
        "embed[sinusoidal]": forward_backward(
            lambda t: ops.embed(tokens, t, scale=2.0, padding_id=0, dropout_rate=0.1, seed=seed),
            normal(10, (101, 72), dtype),
        ),
        "embed[one id everywhere: runs split into chunks]": forward_backward(
            lambda t: ops.embed(jnp.zeros((5, 203), jnp.int32), t, dropout_rate=0.1, seed=seed),
            normal(24, (2, 72), dtype),
        ),
        "label_smoothed_cross_entropy": forward_backward(
            lambda logits: ops.label_smoothed_cross_entropy(logits, labels, epsilon=0.1, pad_id=0),
            normal(11, (2, 3, 1003), dtype),
        ),
        # no gradient: the quantization alone, over ragged tiles (scalar paths) and whole ones (vector paths)
        "fp8_quantize[ragged]": (
            jax.jit(lambda x: ops.fp8_quantize(x, history, jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn)),
            (normal(25, (77, hidden), dtype),),
        ),
        "fp8_quantize[whole tiles]": (
            jax.jit(lambda x: ops.fp8_quantize(x, history, jnp.ones((1,), jnp.float32), jnp.float8_e5m2)),
            (normal(26, (128, 192), dtype),),
        ),
        "fp8_quantize[rows a multiple of 8, not 16]": (  # q_t's rows 8-byte aligned
            jax.jit(lambda x: ops.fp8_quantize(x, history, jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn)),
            (normal(28, (72, 192), dtype),),
        ),
        "fp8_quantize[more tiles than blocks]": (  # 33 x 34 tiles: blocks loop over several (132 SMs x 8 blocks)
            jax.jit(lambda x: ops.fp8_quantize(x, history, jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn)),
            (normal(27, (2112, 2176), dtype),),
        ),
    }


def optimizer_cases() -> dict[str, Case]:
    mixed = {"w": normal(12, (67, 33), jnp.float32), "b": normal(13, (33,), jnp.bfloat16)}
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mixed)

    def step(tx: optax.GradientTransformation, params: Any) -> Case:
        def run(params, grads):
            updates, _ = tx.update(grads, tx.init(params), params)
            return optax.apply_updates(params, updates)

        return jax.jit(run), (params, jax.tree.map(lambda p: (0.1 * p).astype(p.dtype), params))

    def scaled_step(tx: optax.GradientTransformation, params: Any) -> Case:
        """``fused_apply_scaled`` with f32 gradients: the kernel's scale, its clipping and the norm it writes."""

        def run(params, grads):
            return ls_jax.optim.fused_apply_scaled(tx, grads, tx.init(params), params, 0.5)

        return jax.jit(run), (params, jax.tree.map(lambda p: 0.1 * p.astype(jnp.float32), params))

    master = ls_jax.optim.adamw(1e-3, weight_decay=0.01, storage_dtype=jnp.bfloat16, master_weights=True)
    clipped_master = ls_jax.optim.adamw(1e-3, max_grad_norm=0.01, storage_dtype=jnp.bfloat16, master_weights=True)
    return {
        "adan+clip": step(
            optax.chain(optax.clip_by_global_norm(1.0), ls_jax.optim.adan(1e-3, weight_decay=0.01)), mixed
        ),
        "adamw": step(ls_jax.optim.adamw(1e-3, weight_decay=0.01), mixed),
        "adamw+master": step(master, bf16),
        "adamw+master scaled and clipped": scaled_step(clipped_master, bf16),
    }


def main(only: list[str]) -> int:
    with backend.use("ffi"):
        every_target = set(backend.kernel_targets())
        all_cases = {f"{name} {jnp.dtype(dtype).name}": case for dtype in DTYPES for name, case in cases(dtype).items()}
        all_cases.update(optimizer_cases())
        if only:
            all_cases = {name: case for name, case in all_cases.items() if any(part in name for part in only)}
        called: set[str] = set()
        for name, (fn, args) in all_cases.items():
            compiled = fn.lower(*args).compile()
            called |= set(re.findall(r'custom_call_target="(ls_\w+)"', compiled.as_text()))
            jax.block_until_ready(compiled(*args))
            print(f"ran {name}", flush=True)
    if only:
        print(f"ran {len(all_cases)} selected cases")
        return 0
    missing = every_target - called
    if missing:
        print(f"not exercised: {sorted(missing)}", file=sys.stderr)
        return 1
    print(f"every kernel ran: {len(called)} targets")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
