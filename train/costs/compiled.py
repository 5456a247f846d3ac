"""What XLA's compiled executables say about a run: how many kernels one optimizer step launches."""

from __future__ import annotations

import concurrent.futures
import contextvars
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import ls_jax.optim

# Instructions of an ENTRY computation that launch no kernel: they name, pack or reinterpret buffers.
_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(", re.MULTILINE)


def entry_kernels(hlo_text: str) -> int:
    """Instructions of the ENTRY computation of optimized HLO text that launch work: each fusion, custom call
    (an FFI kernel), copy or unfused op counts once. Work inside a loop body (a ``while``) counts as that one op."""
    start = hlo_text.find("\nENTRY ")
    if start < 0:
        raise ValueError("the HLO text has no ENTRY computation")
    body = hlo_text[start:]
    end = body.find("\n}")
    opcodes = _INSTRUCTION.findall(body[: end if end >= 0 else len(body)])
    return sum(opcode not in _NOT_KERNELS for opcode in opcodes)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def optimizer_step_kernels(tx: optax.GradientTransformation, params: Any, opt_state: Any) -> int:
    """Kernels one optimizer step launches on this platform's default device as the training step runs it
    (``ls_jax.optim.fused_apply_scaled`` on f32 gradients shaped as ``params``: the division by the tokens, the
    update and apply, the gradient norm), counted in the compiled HLO (`entry_kernels`)."""
    step = jax.jit(lambda grads, state, weights: ls_jax.optim.fused_apply_scaled(tx, grads, state, weights, 0.5))
    f32_grads = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.float32), params)
    compiled = step.lower(f32_grads, _abstract(opt_state), _abstract(params)).compile()
    return entry_kernels(compiled.as_text())


def optimizer_step_kernels_later(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, executor: concurrent.futures.Executor
) -> Callable[[], int]:
    """`optimizer_step_kernels` compiled by ``executor`` (a thread), in this thread's context (the kernel backend it
    selected), so that it overlaps what the caller does next; the function returned waits for the count and raises
    what counting raised. ``params`` and ``opt_state`` may be abstract."""
    count = executor.submit(contextvars.copy_context().run, optimizer_step_kernels, tx, params, opt_state)
    return count.result
