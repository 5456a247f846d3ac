"""The parts of the data-parallel training step, each compiled and timed alone, and the per-layer timings the
overlap estimate needs.

Every measurement is a `Pending`: a lowered computation and what to do with its compiled form. `compile_all`
compiles a list of them side by side in threads (XLA compilations release the GIL), so a benchmark with many
configurations pays for its compilations in parallel; they are then timed one after another.

Pieces of a step (`step_pieces`), on one device with one device's batch (on N devices each device runs exactly
this per-device computation; only the gradient all-reduce depends on N):
  forward           the loss (dropout on) of the micro-batch;
  forward_backward  the gradients of the loss (no all-reduce);
  optimizer         the optimizer update as the replicated step runs it (ls_jax.optim.fused_apply_scaled on f32
                    gradients: the division by the tokens, clipping and the global gradient norm), state donated;
  backward          forward_backward - forward.
The all-reduce (`allreduce`) sums a tree shaped like the gradients (the params' shapes and dtype, as the step
all-reduces them) over N devices under ``shard_map``, as the step does, with nothing else in the program.
A layer (`layer_pieces`): one repeated layer's forward, and its forward + backward (the gradients of its params
and its input for a cotangent of ones), on one device's activations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ls_jax.optim
from train.bench import common
from train.bench.steps.scaling_models import BenchModel, LayerKind
from train.harness.parallel import DATA_AXIS

TIMING = {"warmup": 3, "samples": 10, "inner": 5}


@dataclasses.dataclass
class Pending:
    """A lowered computation and ``finish(compiled) -> result`` (which times it)."""

    key: tuple
    lowered: Any
    finish: Callable[[Any], dict[str, Any]]
    compiler_options: dict[str, Any] | None = None  # the XLA options it is compiled with (the training step's)


def compile_all(pending: list[Pending], threads: int) -> dict[tuple, dict[str, Any]]:
    """Compiles every `Pending` (``threads`` at a time), then finishes (times) them one after another."""
    workers = max(1, min(threads, len(pending), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        compiled = list(pool.map(lambda item: item.lowered.compile(item.compiler_options), pending))
    return {item.key: item.finish(executable) for item, executable in zip(pending, compiled)}


def _milliseconds(fn: Callable[[], Any]) -> dict[str, float]:
    timing = common.time_call(fn, **TIMING)
    return {"ms": 1e3 * timing["median_s"], "p10_ms": 1e3 * timing["p10_s"], "p90_ms": 1e3 * timing["p90_s"]}


def _timed(key: tuple, jitted: Any, *args: Any) -> Pending:
    return Pending(key, jitted.lower(*args), lambda compiled: _milliseconds(lambda: compiled(*args)))


def step_pieces(key: tuple, model: BenchModel, state: Any, tx: optax.GradientTransformation) -> list[Pending]:
    """forward, forward_backward and optimizer of ``model`` on one device; ``state`` a 1-device TrainState."""
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), model.batch)
    rng = jax.random.PRNGKey(2)
    loss = lambda params, batch, rng: model.loss_fn({"params": params}, batch, rng)[0]  # noqa: E731
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), state.params)  # values do not matter

    def update(grads, opt_state, params):
        return ls_jax.optim.fused_apply_scaled(tx, grads, opt_state, params, jnp.float32(0.5))

    # The update donates its state: copies, so the other pieces keep theirs.
    holder = jax.tree.map(jnp.copy, {"opt_state": state.opt_state, "params": state.params})

    def run_update(compiled):
        def call():
            holder["params"], holder["opt_state"], norm = compiled(grads, holder["opt_state"], holder["params"])
            return norm

        return _milliseconds(call)

    return [
        _timed((*key, "forward"), jax.jit(loss), state.params, batch, rng),
        _timed((*key, "forward_backward"), jax.jit(jax.grad(loss)), state.params, batch, rng),
        Pending(
            (*key, "optimizer"),
            jax.jit(update, donate_argnums=(1, 2)).lower(grads, holder["opt_state"], holder["params"]),
            run_update,
        ),
    ]


def layer_pieces(key: tuple, kind: LayerKind, params: Any) -> list[Pending]:
    """The forward, and forward + backward, of one layer of ``kind`` with ``params`` (its own) on one device."""
    rng = jax.random.PRNGKey(3)

    def forward(params, x, *rest):
        return kind.module.apply({"params": params}, x, *rest, deterministic=False, rngs={"dropout": rng})

    def forward_backward(params, x, *rest):
        out, vjp = jax.vjp(lambda p, h: forward(p, h, *rest), params, x)
        return vjp(jnp.ones_like(out))

    return [
        _timed((*key, kind.name, "forward"), jax.jit(forward), params, *kind.inputs),
        _timed((*key, kind.name, "forward_backward"), jax.jit(forward_backward), params, *kind.inputs),
    ]


def allreduce(key: tuple, like: Any, devices: list[Any]) -> Pending:
    """The psum over ``devices`` of a tree shaped like ``like`` (arrays or ShapeDtypeStructs): each device holds
    its own copy, as the step's per-device gradients."""
    mesh = Mesh(np.asarray(devices), (DATA_AXIS,))
    n, spec = len(devices), PartitionSpec(DATA_AXIS)
    stacked = jax.jit(
        lambda: jax.tree.map(lambda leaf: jnp.ones((n, *leaf.shape), leaf.dtype), like),
        out_shardings=NamedSharding(mesh, spec),
    )()
    summed = jax.jit(
        jax.shard_map(
            lambda tree: jax.tree.map(lambda x: jax.lax.psum(x, DATA_AXIS), tree),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    return _timed(key, summed, stacked)


def split_of_step(step_ms: float, pieces: dict[str, float], allreduce_ms: float) -> dict[str, float]:
    """The step's time split: forward, backward, all-reduce, optimizer (each timed alone) and the rest (step time
    minus their sum: what overlaps or is not in any piece, negative where pieces overlap in the step)."""
    split = {
        "forward_ms": pieces["forward"],
        "backward_ms": pieces["forward_backward"] - pieces["forward"],
        "allreduce_ms": allreduce_ms,
        "optimizer_ms": pieces["optimizer"],
    }
    return {**split, "rest_ms": step_ms - sum(split.values())}
