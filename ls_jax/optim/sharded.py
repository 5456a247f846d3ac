"""ZeRO-1 for the workspace optimizers: each device of a mesh axis keeps and updates 1/N of the optimizer state.

Every leaf of the parameter tree, flattened and padded with zeros to a multiple of N = ``num_shards`` elements, is
viewed as rows ``(N, c)``, ``c = ceil(size / N)``; device r of the mesh axis owns row r of every leaf. The optimizer
(``ls_jax.optim.adan`` / ``adam`` / ``adamw``, or ``ls_jax.optim.chain`` ending in one) runs unchanged on the tree
of rows a device owns (the *shard tree*: the params' structure, leaf i a vector ``(c_i,)``), so its flat f32
workspaces, and master weights, hold sum_i c_i elements: 1/N of the replicated state up to the padding (at most
N - 1 elements per leaf, plus the workspace's 16-byte alignment). One step inside ``jax.shard_map``, per device r:

    G_r   = rows r of  sum_d grads_d  (/ N with average_gradients)     one reduce-scatter per bucket of leaves
    P_r   = rows r of params
    P'_r, S'_r = tx.apply(G_r, S_r, P_r)                                 the fused step on the shard tree
    params'    = concat_d P'_d, unpadded to each leaf's shape            one all-gather per bucket, params' dtype

Clipping by ``max_grad_norm`` uses the whole gradient's norm, sqrt(psum over the axis of every device's sum of
squares), and a weight-decay mask is evaluated on the whole params (a row decays when its leaf does), so N devices
compute what the replicated optimizer computes from the averaged gradients (to f32 rounding: sums in another
order). A bucket concatenates leaves of one dtype up to ``bucket_bytes``, so there is one collective per bucket
rather than one per leaf. 16-bit params are all-gathered in 16 bits; with master weights the f32 master (for bf16
params its low halves) stays sharded in the state.

    opt = shard_optimizer(ls_jax.optim.adamw(1e-3, max_grad_norm=1.0), axis_name="data", num_shards=mesh.shape["data"])
    state = opt.init(params, out_sharding=opt.state_sharding(mesh))    # leaves (N, ...), row r on device r

    @functools.partial(jax.jit, donate_argnums=(0, 1))                 # the kernel then updates the state in place
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), opt.state_spec(), P("data")),
                       out_specs=(P(), opt.state_spec()))
    def train_step(params, state, batch):
        local = jax.lax.pcast(params, "data", to="varying")     # per-device gradients, not their sum
        grads = jax.grad(loss)(local, batch)
        return opt.apply(grads, state, params)

(With ``check_vma=False`` the gradients of ``params`` themselves are per device; drop the ``pcast``.)

Checkpoints: ``opt.unshard_state(state, params)`` is exactly the state ``tx.init(params)`` has (the logical
workspaces, unpadded per leaf), ``opt.shard_state(replicated, params)`` the inverse, so a run saved with N shards
resumes with M: ``opt_m.shard_state(opt_n.unshard_state(state, params), params)``.

Only the fused transformation sees shard trees correctly: leading transforms of a ``chain`` see rows too, so keep
cross-leaf ones (``optax.clip_by_global_norm``) out of it and pass ``max_grad_norm`` to the optimizer instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ls_jax.optim import _shard_layout as layout_lib
from ls_jax.optim._kernel import varying_axes
from ls_jax.optim.base import FusedGradientTransformation

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class ShardedOptimizer:
    """A fused optimizer whose state is split over the ``num_shards`` devices of mesh axis ``axis_name`` (ZeRO-1).

    Made by ``shard_optimizer``; see ``ls_jax.optim.sharded`` for the math. The state is a pytree of global arrays,
    each with a leading dimension ``num_shards`` (row r is device r's): place it with ``state_sharding(mesh)`` and
    pass it to ``jax.shard_map`` with ``state_spec()``.
    """

    tx: FusedGradientTransformation
    axis_name: str
    num_shards: int
    average_gradients: bool = True
    reduce_dtype: Any = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    # ---- placement ----------------------------------------------------------------------------------------------

    def state_spec(self) -> PartitionSpec:
        """``P(axis_name)``: the spec of every state leaf (a prefix spec for the whole state in ``shard_map``)."""
        return PartitionSpec(self.axis_name)

    def state_specs(self, state: Any) -> Any:
        """The spec of each leaf of ``state`` (a tree of ``PartitionSpec``), e.g. for orbax or ``jit`` shardings."""
        return jax.tree.map(lambda _: self.state_spec(), state)

    def state_sharding(self, mesh: Mesh) -> NamedSharding:
        """``NamedSharding(mesh, P(axis_name))`` after checking that the mesh axis has ``num_shards`` devices."""
        self._check_axis_size(dict(mesh.shape).get(self.axis_name))
        return NamedSharding(mesh, self.state_spec())

    # ---- the optimizer ------------------------------------------------------------------------------------------

    def init(self, params: Any, *, out_sharding: Any = None) -> Any:
        """The sharded state for ``params`` (the values ``tx.init`` takes): ``tx.init`` of every device's shard tree,
        stacked, so every leaf gets a leading dimension ``num_shards``. Runs outside ``shard_map``, as one compiled
        function; ``out_sharding`` (e.g. ``state_sharding(mesh)``) places the state as it is made, so no device
        ever holds all of it."""

        def sharded_init(params):
            return jax.vmap(self.tx.init)(jax.tree.map(lambda p: layout_lib.rows(p, self.num_shards), params))

        return jax.jit(sharded_init, out_shardings=out_sharding)(params)

    def apply(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any]:
        """One step; call inside ``jax.shard_map`` over ``axis_name``.

        Args:
          grads: this device's gradients (the params' structure and shapes), not yet summed over the devices: with
            ``check_vma`` on, differentiate w.r.t. ``jax.lax.pcast(params, axis_name, to="varying")``.
          state: this device's block of the sharded state (leading dimension 1; in_specs ``state_spec()``).
          params: the whole params, the same on every device (in_specs ``P()``), in their storage dtype.
          extra_args: passed on to ``tx.apply``.

        Returns:
          ``(new_params, new_state)``: the whole new params in the params' dtypes (as invariant over the axis as the
          params given), and this device's block of the new state.

        Raises:
          ValueError: not inside ``shard_map`` over ``axis_name``, ``num_shards`` other than the axis size, gradients
            already summed over the axis, gradients not shaped like the params, or a state not made by ``init`` for
            these params and ``num_shards``.
        """
        new_params, new_state, _ = self._apply(grads, state, params, **extra_args)
        return new_params, new_state

    def _apply(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any, Any]:
        """``apply``'s new params and state, and this device's rows of the summed gradients."""
        self._check_axis_size(self._bound_axis_size())
        layout_lib.check_same_shapes("gradients", grads, params)
        self._check_local_gradients(grads, state)
        grad_rows = layout_lib.reduce_scatter(
            grads,
            self.axis_name,
            self.num_shards,
            average=self.average_gradients,
            reduce_dtype=self.reduce_dtype,
            bucket_bytes=self.bucket_bytes,
        )
        new_params, new_state = self._apply_rows(grad_rows, state, params, **extra_args)
        return new_params, new_state, grad_rows

    def apply_rows_with_grad_norm(
        self, grad_rows: Any, state: Any, params: Any, **extra_args: Any
    ) -> tuple[Any, Any, jax.Array]:
        """``apply_with_grad_norm`` for gradients already summed and scattered: ``grad_rows`` is this device's row
        ``(c_i,)`` of every leaf of ``sum_d grads_d`` (``ls_jax.optim.GradientSync`` with this optimizer gives
        them, reduce-scattered inside the backward). Nothing is averaged here."""
        self._check_axis_size(self._bound_axis_size())
        new_params, new_state = self._apply_rows(grad_rows, state, params, **extra_args)
        return new_params, new_state, self._grad_norm(grad_rows)

    def _apply_rows(self, grad_rows: Any, state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any]:
        """The fused step on this device's rows, then the all-gather of the new params."""
        local_state = self._local_state(state, params)
        param_rows = layout_lib.own_rows(params, self.axis_name, self.num_shards)
        new_rows, new_state = self.tx.apply(
            grad_rows, local_state, param_rows, grad_norm_axis=self.axis_name, mask_params=params, **extra_args
        )
        invariant = self.axis_name not in set().union(*map(varying_axes, jax.tree.leaves(params)))
        new_params = layout_lib.all_gather(
            new_rows, params, self.axis_name, self.num_shards, invariant=invariant, bucket_bytes=self.bucket_bytes
        )
        return new_params, jax.tree.map(lambda x: x[None], new_state)

    def apply_with_grad_norm(
        self, grads: Any, state: Any, params: Any, **extra_args: Any
    ) -> tuple[Any, Any, jax.Array]:
        """``apply``, and the global norm of the summed gradients (before clipping), ``sqrt(psum_d |G_d|^2)``: a
        scalar the same on every device, from the rows each device holds after the reduce-scatter."""
        new_params, new_state, grad_rows = self._apply(grads, state, params, **extra_args)
        return new_params, new_state, self._grad_norm(grad_rows)

    def _grad_norm(self, grad_rows: Any) -> jax.Array:
        squares = sum(jnp.sum(jnp.square(row.astype(jnp.float32))) for row in jax.tree.leaves(grad_rows))
        return jnp.sqrt(jax.lax.psum(squares, self.axis_name))

    # ---- conversion for checkpoints -----------------------------------------------------------------------------

    def unshard_state(self, state: Any, params: Any, *, out_sharding: Any = None) -> Any:
        """The replicated state (exactly what ``tx.init(params)`` and its steps hold) of sharded ``state``.

        Per state leaf: a workspace ``(N, W_shard)`` becomes the whole-tree workspace ``(W,)``, each leaf's rows
        joined and unpadded; a per-parameter leaf ``(N, c_i)`` (master weights) becomes the leaf's shape; a leaf the
        same on every device (the step count, injected hyperparameters) takes row 0. ``params`` gives only shapes and
        dtypes (arrays or ``jax.ShapeDtypeStruct``s); ``out_sharding`` places the result. One compiled function.
        Raises ValueError when ``state`` was not made by ``init`` for these params and ``num_shards``."""
        plan = self._plan(params)
        return jax.jit(plan.unshard, out_shardings=out_sharding)(self._checked(state, plan))

    def shard_state(self, replicated: Any, params: Any, *, out_sharding: Any = None) -> Any:
        """The sharded state for ``num_shards`` devices of a replicated state (``tx.init(params)``'s structure, e.g.
        ``unshard_state`` of a state from any number of shards): the inverse of ``unshard_state``, zeros in the
        padding. ``params`` and ``out_sharding`` as in ``unshard_state``. Raises ValueError on another structure."""
        plan = self._plan(params)
        return jax.jit(plan.shard, out_shardings=out_sharding)(plan.check_replicated(replicated))

    def _plan(self, params: Any) -> layout_lib.StatePlan:
        shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
        return layout_lib.StatePlan.build(self.tx, shapes, self.num_shards)

    # ---- checks -------------------------------------------------------------------------------------------------

    def _bound_axis_size(self) -> int:
        try:
            return jax.lax.axis_size(self.axis_name)
        except NameError:
            raise ValueError(
                f"ShardedOptimizer.apply runs inside jax.shard_map over mesh axis {self.axis_name!r}, "
                f"which is not bound here"
            ) from None

    def _check_axis_size(self, size: int | None) -> None:
        if size is None:
            raise ValueError(f"the mesh has no axis {self.axis_name!r} to shard the optimizer state over")
        if size != self.num_shards:
            raise ValueError(
                f"num_shards={self.num_shards} but mesh axis {self.axis_name!r} has {size} devices: make the "
                f"optimizer with num_shards={size} (a state from {self.num_shards} shards converts with "
                f"unshard_state then shard_state)"
            )

    def _check_local_gradients(self, grads: Any, state: Any) -> None:
        """With vma checking on (the state varies over the axis), gradients that do not vary are already summed."""
        if not any(self.axis_name in varying_axes(x) for x in jax.tree.leaves(state)):
            return
        summed = [x for x in jax.tree.leaves(grads) if self.axis_name not in varying_axes(x)]
        if summed:
            raise ValueError(
                f"{len(summed)} gradient leaves are the same on every device of {self.axis_name!r} (already summed by "
                f"autodiff of replicated params): differentiate w.r.t. jax.lax.pcast(params, {self.axis_name!r}, "
                f"to='varying') so apply gets per-device gradients"
            )

    def _local_state(self, state: Any, params: Any) -> Any:
        """This device's state (its block without the leading dimension), checked against ``tx.init`` of a shard."""
        hint = f"made by init for these params with num_shards={self.num_shards}"
        expected = jax.eval_shape(self.tx.init, layout_lib.shard_params_like(params, self.num_shards))
        blocked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype), expected)
        layout_lib.check_state_like("this device's block of the optimizer state", state, blocked, hint)
        return jax.tree.map(lambda x: x[0], state)

    def _checked(self, state: Any, plan: layout_lib.StatePlan) -> Any:
        stacked = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((self.num_shards, *s.shape), s.dtype), plan.shard_template
        )
        layout_lib.check_state_like(
            "sharded optimizer state",
            state,
            stacked,
            f"made by init for these params with num_shards={self.num_shards}",
        )
        return state


def shard_optimizer(
    tx: FusedGradientTransformation,
    axis_name: str = "data",
    *,
    num_shards: int,
    average_gradients: bool = True,
    reduce_dtype: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ShardedOptimizer:
    """ZeRO-1 for ``tx``: optimizer state split over the ``num_shards`` devices of mesh axis ``axis_name``.

    Args:
      tx: an ls_jax workspace optimizer (``adan``, ``adam``, ``adamw``), or ``ls_jax.optim.chain`` ending in one.
      axis_name: the mesh axis the data (and now the optimizer state) is split over.
      num_shards: the size of that axis.
      average_gradients: divide the summed gradients by ``num_shards`` (per-device mean losses); False keeps the
        sum (losses already normalized by the global batch).
      reduce_dtype: dtype the gradients are summed in (e.g. float32 for 16-bit gradients); None, the gradients'.
      bucket_bytes: most bytes of one reduce-scatter or all-gather (a larger leaf goes alone).

    Raises:
      ValueError: ``tx`` without a fused apply, or a bad ``num_shards`` / ``bucket_bytes``.
    """
    if not isinstance(tx, FusedGradientTransformation):
        raise ValueError(
            f"shard_optimizer needs an ls_jax.optim optimizer (adan, adam, adamw, or ls_jax.optim.chain ending in "
            f"one), got {type(tx).__name__}"
        )
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool) or num_shards < 1:
        raise ValueError(
            f"num_shards must be a positive integer (the size of mesh axis {axis_name!r}), got {num_shards!r}"
        )
    if not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    return ShardedOptimizer(tx, axis_name, int(num_shards), average_gradients, reduce_dtype, int(bucket_bytes))
