"""One optimizer step: the train state, fp16 dynamic loss scaling, and gradient accumulation over micro-batches.

A task supplies ``loss_fn(variables, micro_batch, rng) -> (loss_sum, weight, sums)``: the summed loss of one
micro-batch, the weight it is normalized by (target tokens, examples) and other sums to report per weight (e.g.
``nll``); ``variables`` are the model's Flax variables, its ``params`` and, for a model that multiplies in FP8,
its scaling state (`ls_jax.layers.fp8`). One step (`make_train_step`) scans over the micro-batches, summing
gradients of the summed loss, and divides by the total weight, so accumulation gives the gradient of the mean over
every token of the step:

    g = sum_i grad(loss_sum_i) / sum_i weight_i

then applies the optimizer (``ls_jax.optim.fused_apply_scaled``: an ls_jax optimizer divides by the weight and
measures the gradient's norm inside its own pass over the gradients; other transformations, and ZeRO-1, divide
and measure in XLA first). With fp16 the loss is multiplied by a dynamic
scale s before differentiation and the gradients by 1/s after; a step whose gradients are not finite is skipped
(parameters and optimizer state unchanged), the scale halves, and it doubles after ``growth_interval`` finite
steps in a row. Without loss scaling a non-finite loss or gradient is reported (``finite``) for the loop to stop.

FP8 scaling state is differentiated beside the params, and its gradient is its next value (each quantized
tensor's amax history and scale, `ls_jax.layers.fp8`): never passed to the optimizer or counted in the gradient
norm; micro-batches and devices combine theirs by the maximum, so every replica quantizes alike.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import config as jax_config

import ls_jax.optim
from ls_jax.layers import fp8
from ls_jax.optim import GradientSync, ShardedOptimizer
from ls_jax.optim.gradient_sync import DEFAULT_BUCKET_BYTES

Batch = dict[str, np.ndarray]
LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class DynamicLossScale:
    """fp16 loss scale: halves on a non-finite step, doubles after ``growth_interval`` finite steps."""

    scale: jax.Array  # f32 scalar
    finite_steps: jax.Array  # int32 scalar: finite steps since the last change
    growth_interval: int = flax.struct.field(pytree_node=False, default=2000)

    @classmethod
    def create(cls, initial_scale: float = 2.0**7, growth_interval: int = 2000) -> DynamicLossScale:
        """Starts at 2**7 as fairseq does: the loss being scaled is a sum over thousands of tokens."""
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), growth_interval)

    def update(self, finite: jax.Array) -> DynamicLossScale:
        grow = finite & (self.finite_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2.0, self.scale), jnp.maximum(self.scale * 0.5, 1.0))
        finite_steps = jnp.where(finite & ~grow, self.finite_steps + 1, 0)
        return self.replace(scale=scale, finite_steps=finite_steps)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; a checkpoint saves exactly this."""

    step: jax.Array  # int32 scalar: steps taken (skipped fp16 steps included)
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] base key; step n uses fold_in(rng, n)
    loss_scale: DynamicLossScale | None = None
    scaling: Any = None  # FP8 scaling state (`ls_jax.layers.fp8.SCALING`), None without FP8

    @property
    def variables(self) -> dict[str, Any]:
        """The model's Flax variables: ``params`` and, with FP8, the scaling state."""
        return fp8.with_scaling({"params": self.params}, self.scaling)

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array,
        *,
        fp16: bool,
        param_dtype: Any = None,
        init_optimizer: Callable[[Any], Any] | None = None,
        scaling: Any = None,
    ) -> TrainState:
        """The step-0 state; ``param_dtype`` casts the params after the optimizer's init has seen them (master
        weights: the optimizer keeps the f32 values, the model trains the cast ones). ``init_optimizer`` replaces
        ``tx.init`` (e.g. a sharded optimizer's). ``scaling``: an FP8 model's initial scaling state."""
        opt_state = (init_optimizer or tx.init)(params)
        if param_dtype is not None:
            params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=rng,
            loss_scale=DynamicLossScale.create() if fp16 else None,
            scaling=scaling or None,
        )


def threefry_kernel() -> contextlib.AbstractContextManager:
    """Inside, JAX draws threefry random bits on a GPU with its own kernel instead of XLA operations: the same
    bits, and no effect on other platforms. The setting holds for this thread only, so a program another thread
    compiles meanwhile (the optimizer's kernel count, `train.costs.compiled`) keeps XLA's threefry and the same
    compilation-cache key in every run.

    Drawing a model's parameters runs threefry once per tensor, and as XLA operations each draw's rounds are
    inlined into fusions of their own, which XLA compiles slowly on a GPU (BERT-base: docs/results/README.md,
    "The study's grid on one H200"). The kernel reads its keys and counters broadcast to each tensor's size, a
    transient cost at creation only. The training step keeps XLA's threefry, so its dropout draws fuse with their
    neighbours.
    """
    return jax_config.threefry_gpu_kernel_lowering(True)  # JAX's thread-local form of the flag


def _sum_trees(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    axis_name: str | None = None,
    sharded_optimizer: ShardedOptimizer | None = None,
    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    grad_comm_dtype: Any = None,
) -> Callable[[TrainState, Batch], tuple]:
    """``step(state, batch) -> (state, metrics)``; batch leaves have shape (grad_accum, rows, ...).

    ``metrics`` holds the sums over the step (``loss``, ``weight`` and the task's sums), the global gradient
    norm before clipping, ``finite`` and the loss scale used (1 without fp16).

    With ``axis_name`` the step runs inside ``jax.shard_map`` over that mesh axis on this device's rows
    (`train.harness.parallel`): each device draws its own dropout streams (the step key folded with the axis index)
    and sums its earlier micro-batches' gradients locally; the last micro-batch's backward sums every device's
    gradients bucket by bucket as it produces them (``ls_jax.optim.GradientSync``: buckets of
    ``grad_bucket_bytes``, sent in ``grad_comm_dtype``, None for the params' dtype), so the communication runs under the
    backward of the layers below; with ``sharded_optimizer`` (ZeRO-1) each bucket is reduce-scattered instead. The
    loss sums are combined by psum. Dividing by the global weight makes the update the one a single device
    computes on the whole batch.
    """
    sync = None if axis_name is None else GradientSync(axis_name, grad_bucket_bytes, grad_comm_dtype, sharded_optimizer)

    def gradients(state: TrainState, batch: Mapping[str, jax.Array], scale: jax.Array) -> tuple[Any, Any, dict]:
        """The f32 gradients of the scaled loss summed over every micro-batch and device (under ZeRO-1: this
        device's rows of them), the next FP8 scaling state (empty without FP8) and the loss sums."""
        step_rng = jax.random.fold_in(state.rng, state.step)
        if axis_name is not None:
            step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))
        scaling = state.scaling or {}
        if axis_name is not None:  # each device's amax until they are combined
            scaling = jax.lax.pcast(scaling, axis_name, to="varying")

        def scaled_loss(params, scaling, micro_batch, index):
            variables = fp8.with_scaling({"params": params}, scaling)
            loss_sum, weight, sums = loss_fn(variables, micro_batch, jax.random.fold_in(step_rng, index))
            totals = {"loss": loss_sum, "weight": weight, **sums}
            return loss_sum * scale, jax.tree.map(lambda x: x.astype(jnp.float32), totals)

        def local_step(params, index, micro_batch):
            """This device's f32 gradients of one micro-batch, not summed over the devices, the scaling state it
            leaves and its loss sums."""
            (grads, next_scaling), totals = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)(
                params, scaling, micro_batch, index
            )
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), next_scaling, totals

        def combine(a, b):
            return _sum_trees(a[0], b[0]), fp8.combine_scaling(a[1], b[1]), _sum_trees(a[2], b[2])

        def local_sums(micro_batches):
            """This device's gradient and loss sums over ``micro_batches`` (leading axis) and their scaling state,
            not combined over devices."""
            params = state.params
            if axis_name is not None:
                params = jax.lax.pcast(params, axis_name, to="varying")  # per-device gradients

            def accumulate(carry, inputs):
                return combine(carry, local_step(params, *inputs)), None

            # The first micro-batch starts the sums, so one needs no loop at all.
            sums = local_step(params, 0, jax.tree.map(lambda x: x[0], micro_batches))
            count = jax.tree.leaves(micro_batches)[0].shape[0]
            if count > 1:
                rest = jax.tree.map(lambda x: x[1:], micro_batches)
                sums, _ = jax.lax.scan(accumulate, sums, (jnp.arange(1, count), rest))
            return sums

        # One device needs no overlap, and its all-reduce is free (XLA removes it); ZeRO-1 still wants its rows.
        one_device = sync is None or (sharded_optimizer is None and jax.lax.axis_size(axis_name) == 1)
        if one_device:
            grads, next_scaling, totals = local_sums(batch)
            if axis_name is not None:
                grads = jax.lax.psum(grads, axis_name)
        else:  # the earlier micro-batches' sums join the last one's in its backward's collectives
            num_micro = jax.tree.leaves(batch)[0].shape[0]
            carried = earlier = None
            if num_micro > 1:
                carried, earlier_scaling, earlier = local_sums(jax.tree.map(lambda x: x[:-1], batch))
            last = jax.tree.map(lambda x: x[-1], batch)
            (grads, next_scaling), totals = sync.grad(
                scaled_loss, state.params, last, num_micro - 1, carried=carried, local=scaling
            )
            if earlier is not None:
                totals = _sum_trees(earlier, totals)
                next_scaling = fp8.combine_scaling(earlier_scaling, next_scaling)
        if axis_name is not None:
            totals = jax.lax.psum(totals, axis_name)
            next_scaling = jax.lax.pmax(next_scaling, axis_name)  # every replica quantizes alike next step
        return grads, next_scaling, totals

    def update(state: TrainState, grads: Any, denominator: jax.Array) -> tuple[Any, Any, jax.Array]:
        """(params, opt_state, global gradient norm) after the optimizer step on the summed gradients divided by
        ``denominator`` (under ZeRO-1 this device's rows of them)."""
        if sharded_optimizer is not None:
            rows = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads, state.params)
            return sharded_optimizer.apply_rows_with_grad_norm(rows, state.opt_state, state.params)
        return ls_jax.optim.fused_apply_scaled(tx, grads, state.opt_state, state.params, 1.0 / denominator)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        scale = jnp.float32(1.0) if state.loss_scale is None else state.loss_scale.scale
        grads, next_scaling, totals = gradients(state, batch, scale)
        denominator = scale * jnp.maximum(totals["weight"], 1.0)
        params, opt_state, grad_norm = update(state, grads, denominator)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(totals["loss"])
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        step_metrics = {**totals, "grad_norm": grad_norm, "finite": finite, "loss_scale": scale}
        if state.scaling is not None:
            new_state = new_state.replace(scaling=fp8.new_scaling(next_scaling))
            step_metrics.update(fp8_metrics(new_state.scaling))
        if state.loss_scale is not None:
            keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731 - skip a non-finite fp16 step
            new_state = new_state.replace(
                params=jax.tree.map(keep_old, params, state.params),
                opt_state=jax.tree.map(keep_old, opt_state, state.opt_state),
                loss_scale=state.loss_scale.update(finite),
            )
        return new_state, step_metrics

    return train_step


def fp8_metrics(scaling: Any) -> dict[str, jax.Array]:
    """What a step's FP8 quantization clipped, from the scaling state it left (`ls_jax.layers.fp8.amax_ratio_vector`):
    ``fp8_overflows``, how many quantized tensors held a value beyond what their scale let FP8 hold (a ratio above
    1), and ``fp8_amax_ratio``, the largest ratio."""
    _, ratios = fp8.amax_ratio_vector(scaling)
    return {"fp8_overflows": jnp.sum(ratios > 1.0, dtype=jnp.int32), "fp8_amax_ratio": jnp.max(ratios)}
