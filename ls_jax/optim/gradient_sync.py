"""Data-parallel gradients summed inside the backward: each bucket's all-reduce starts once its gradients exist.

Inside ``jax.shard_map`` over a mesh axis of N devices, a data-parallel step needs ``G = sum_d g_d``, the sum of
every device's gradient. Summed after the backward (one ``psum`` of the whole tree), the communication waits for
the last gradient and then runs alone. ``GradientSync.grad`` instead groups the parameter leaves into buckets in
the order the backward finishes them (the reverse of their first use in the forward) and wraps them in an
identity whose backward rule sums each bucket's gradient over the axis, the buckets one after another. The
collective of the last layer's bucket is then issued while the backward of the layers below it still runs, so
XLA's asynchronous collectives can run the two at once, as DDP's bucketed all-reduce does in PyTorch.

With a ZeRO-1 optimizer (``ls_jax.optim.shard_optimizer``) a bucket is reduce-scattered instead: the step gets
this device's rows of ``G`` (``ShardedOptimizer.apply_rows_with_grad_norm``). Earlier micro-batches' gradients
(gradient accumulation) are summed locally and passed as ``carried``: they join the last micro-batch's in the same
collectives, so an accumulated step communicates once.

The identity's backward returns the summed gradient as the cotangent of a *receiver*, a zero tree of the result's
shape (the params' shapes, or rows under ZeRO-1) that ``grad`` differentiates with respect to, so the result can
have another shape and dtype than the params; the params themselves get a zero cotangent, which XLA removes.

    sync = GradientSync("data", bucket_bytes=25 * 2**20)
    grads, aux = sync.grad(loss_fn, params, batch)   # inside shard_map: G, the same on every device
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.optim import _shard_layout as layout_lib
from ls_jax.optim.sharded import ShardedOptimizer

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket

_layer_order = threading.local()


@contextlib.contextmanager
def backward_in_layer_order() -> Iterator[None]:
    """While a loss is traced inside it, the ls_jax layer stacks finish each layer's parameter gradients before the
    backward of the layer below starts (`ls_jax.layers.transformer`), as PyTorch's autograd runs them.

    Left free, XLA's GPU schedulers (the default one and the latency-hiding one alike) put every weight-gradient
    product after the rest of the backward, since nothing but the update reads them: on two H200s the 60 products
    of transformer-big's 12 layers ran after the last LayerNorm backward, so no bucket's all-reduce could start
    before it. In this order they run inside their layers' backward, and with XLA's option to start collectives as
    early as possible (`train.harness.parallel.DataParallel.compiler_options`) the buckets' all-reduces run beside
    them (docs/results/README.md, scale-out). `GradientSync.grad` traces the loss inside this context.
    """
    previous = getattr(_layer_order, "active", False)
    _layer_order.active = True
    try:
        yield
    finally:
        _layer_order.active = previous


def layer_order_requested() -> bool:
    """Whether the code being traced runs inside `backward_in_layer_order` (on this thread)."""
    return getattr(_layer_order, "active", False)


def backward_order(fun: Callable[..., Any], params: Any, *args: Any) -> list[int]:
    """Indices of ``params``' leaves in the order the backward of ``fun(params, *args)`` completes their gradients:
    by first use in the forward, latest first (a leaf used twice, such as a tied embedding, completes when its
    first use is differentiated); leaves ``fun`` does not use come last.

    The forward is traced once (``jax.make_jaxpr``); calls, remat and scans are followed into their bodies.
    """
    closed = jax.make_jaxpr(fun)(params, *args)
    num_leaves = len(jax.tree.leaves(params))
    first_use: dict[int, int] = {}
    leaf_of = {var: i for i, var in enumerate(closed.jaxpr.invars[:num_leaves])}
    _record_uses(closed.jaxpr, leaf_of, first_use, itertools.count())
    return sorted(range(num_leaves), key=lambda i: -first_use.get(i, -1))


def _record_uses(jaxpr: Any, leaf_of: dict[Any, int], first_use: dict[int, int], clock: Iterator[int]) -> None:
    """Sets ``first_use[leaf]`` to the tick of ``clock`` of the first equation reading a variable of ``leaf_of``,
    entering an equation's body where its operands map one to one onto the body's inputs."""
    for eqn in jaxpr.eqns:
        now = next(clock)
        body = _body(eqn)
        if body is not None:
            inner = {v: leaf_of[o] for o, v in zip(eqn.invars, body.invars) if _is_var(o) and o in leaf_of}
            _record_uses(body, inner, first_use, clock)
        else:
            for operand in eqn.invars:
                if _is_var(operand) and operand in leaf_of:
                    first_use.setdefault(leaf_of[operand], now)


def _body(eqn: Any) -> Any:
    """The one sub-jaxpr of a call-like equation whose inputs are its operands in order, else None."""
    bodies = [getattr(value, "jaxpr", value) for value in eqn.params.values()]
    bodies = [body for body in bodies if hasattr(body, "eqns") and len(body.invars) == len(eqn.invars)]
    return bodies[0] if len(bodies) == 1 else None


def _is_var(atom: Any) -> bool:
    return not hasattr(atom, "val")  # a Literal has a value; a Var does not


def plan_buckets(nbytes: Sequence[int], order: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive leaves of ``order`` grouped into buckets of at most ``bucket_bytes`` (a larger leaf alone)."""
    planned: list[list[int]] = []
    total = 0
    for index in order:
        if not planned or total + nbytes[index] > bucket_bytes:
            planned.append([])
            total = 0
        planned[-1].append(index)
        total += nbytes[index]
    return planned


@dataclasses.dataclass(frozen=True)
class GradientSync:
    """Sums data-parallel gradients over ``axis_name`` inside the backward, one collective per bucket.

    Attributes:
      axis_name: the shard_map mesh axis of the data-parallel devices.
      bucket_bytes: the most bytes of communicated gradient per collective (a larger leaf goes alone); a value
        at least the size of all gradients gives one collective after the whole backward.
      comm_dtype: the dtype gradients travel and are summed in (e.g. ``jnp.bfloat16``, as DDP's compression
        hook); None: the params' (a bucket of mixed dtypes: the widest). The sum is returned in float32 either way.
      sharded: a ZeRO-1 optimizer: reduce-scatter each bucket to this device's rows instead of all-reducing it.
    """

    axis_name: str
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    comm_dtype: Any = None
    sharded: ShardedOptimizer | None = None
    # backward_order by (loss code, params structure and shapes): a step compiled for several batch shapes traces
    # its forward for the order once.
    _orders: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.sharded is not None and self.sharded.axis_name != self.axis_name:
            raise ValueError(
                f"the sharded optimizer splits over axis {self.sharded.axis_name!r}, not {self.axis_name!r}"
            )

    def grad(
        self,
        fun: Callable[..., tuple[jax.Array, Any]],
        params: Any,
        *args: Any,
        carried: Any = None,
        local: Any = None,
    ) -> tuple[Any, Any]:
        """``(G, aux)`` for ``fun(params, *args) -> (loss, aux)``, called inside ``shard_map`` over the axis.

        ``G`` is ``sum_d (grad_d + carried_d)`` over the axis devices in float32: a tree of the params' shapes,
        the same on every device, or with ``sharded`` this device's rows (``(c_i,)`` per leaf, as
        ``ShardedOptimizer.apply_rows_with_grad_norm`` takes them). ``params`` are the same on every device;
        ``carried`` (the params' structure and shapes, float32, per device) is this device's gradient of earlier
        micro-batches. With ``local`` (a tree differentiated beside the params but not summed, e.g. FP8 scaling
        state, whose gradient is its next value), ``fun(params, local, *args)`` and ``((G, local's gradient on
        this device), aux)``.
        """
        call = (lambda p, _local, *a: fun(p, *a)) if local is None else fun  # noqa: E731
        leaves, treedef = jax.tree.flatten(params)
        carried_leaves = [None] * len(leaves) if carried is None else treedef.flatten_up_to(carried)
        key = (getattr(fun, "__code__", fun), treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
        if key not in self._orders:
            self._orders[key] = backward_order(lambda p, *a: call(p, local, *a)[0], params, *args)
        order = self._orders[key]
        nbytes = [leaf.size * self._comm_dtype([leaf.dtype]).itemsize for leaf in leaves]
        buckets = plan_buckets(nbytes, order, self.bucket_bytes)
        receivers = [self._receivers([leaves[i] for i in bucket]) for bucket in buckets]

        identity = self._identity()

        def loss_of_receivers(receivers, local):
            by_bucket = identity(
                [[leaves[i] for i in bucket] for bucket in buckets],
                [[carried_leaves[i] for i in bucket] for bucket in buckets],
                receivers,
            )
            synced: list[Any] = [None] * len(leaves)
            for bucket, outputs in zip(buckets, by_bucket):
                for i, out in zip(bucket, outputs):
                    synced[i] = out
            return call(jax.tree.unflatten(treedef, synced), local, *args)

        with backward_in_layer_order():
            (summed, local_grad), aux = jax.grad(loss_of_receivers, argnums=(0, 1), has_aux=True)(receivers, local)
        out: list[Any] = [None] * len(leaves)
        for bucket, received in zip(buckets, summed):
            for i, value in zip(bucket, received):
                out[i] = value
        grads = jax.tree.unflatten(treedef, out)
        return (grads if local is None else (grads, local_grad)), aux

    def _receivers(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """Zeros shaped like what the bucket's collective returns: the leaves, or under ZeRO-1 this device's rows."""
        if self.sharded is None:
            return [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves]
        n = self.sharded.num_shards
        rows = [jnp.zeros((layout_lib.row_length(leaf.size, n),), jnp.float32) for leaf in leaves]
        return jax.lax.pcast(rows, self.axis_name, to="varying")

    def _comm_dtype(self, param_dtypes: Sequence[Any]) -> np.dtype:
        return jnp.dtype(self.comm_dtype) if self.comm_dtype is not None else jnp.result_type(*param_dtypes)

    def _reduce(self, totals: list[jax.Array], param_dtypes: list[Any]) -> list[jax.Array]:
        """One bucket's collective: float32 ``totals`` summed over the axis in the communication dtype, back in
        float32."""
        comm = self._comm_dtype(param_dtypes)
        if self.sharded is None:  # one flat buffer, one all-reduce (XLA's combiner still joins buckets of a few MiB)
            flat = jnp.concatenate([t.astype(comm).reshape(-1) for t in totals])
            summed = jax.lax.psum(flat, self.axis_name).astype(jnp.float32)
            ends = np.cumsum([t.size for t in totals])
            return [summed[end - t.size : end].reshape(t.shape) for end, t in zip(ends, totals)]
        rows = layout_lib.reduce_scatter(
            totals,
            self.axis_name,
            self.sharded.num_shards,
            average=False,
            reduce_dtype=comm,
            bucket_bytes=sum(t.size for t in totals) * comm.itemsize,
        )
        return [r.astype(jnp.float32) for r in rows]

    def _identity(self) -> Callable[[list, list, list], list]:
        """``f(leaves, carried, receivers) -> leaves``, each a list per bucket, made per-device; its backward sends
        each bucket's summed cotangent (plus ``carried``) to its receivers through ``_reduce`` and zeros to the
        leaves.
        """
        axis_name = self.axis_name

        @jax.custom_vjp
        def identity(leaves, carried, receivers):
            return jax.lax.pcast(leaves, axis_name, to="varying")

        def forward(leaves, carried, receivers):
            return identity(leaves, carried, receivers), carried

        def backward(carried, cotangents):
            summed = []
            for bucket_cotangents, bucket_carried in zip(cotangents, carried):
                totals = [
                    ct.astype(jnp.float32) if c is None else ct.astype(jnp.float32) + c
                    for ct, c in zip(bucket_cotangents, bucket_carried)
                ]
                summed.append(self._reduce(totals, [ct.dtype for ct in bucket_cotangents]))
            zeros = [[jnp.zeros(ct.shape, ct.dtype) for ct in bucket] for bucket in cotangents]
            no_carried = [[None if c is None else jnp.zeros_like(c) for c in bucket] for bucket in carried]
            return zeros, no_carried, summed

        identity.defvjp(forward, backward)
        return identity
