"""How ZeRO-1 (``ls_jax.optim.sharded``) cuts leaves into rows, moves them between devices, and converts states.

A leaf of ``size`` elements is flattened, padded with zeros to ``N * c`` elements, ``c = ceil(size / N)``, and
viewed as rows ``(N, c)``; device r owns row r. The collectives work on buckets: leaves of one dtype, in tree order,
concatenated along the row axis into ``(N, sum c_i)`` up to a byte budget, so a bucket is one reduce-scatter (or
one all-gather) whatever its number of leaves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.optim.workspace import WorkspaceLayout


def row_length(size: int, num_shards: int) -> int:
    """c = ceil(size / N): the elements of a ``size``-element leaf each of N devices owns (1 for a scalar)."""
    return max(1, -(-size // num_shards))


def rows(leaf: jax.Array, num_shards: int) -> jax.Array:
    """``leaf`` flattened, zero-padded and reshaped to ``(N, c)``."""
    flat = jnp.reshape(leaf, (-1,))
    c = row_length(flat.shape[0], num_shards)
    return jnp.pad(flat, (0, num_shards * c - flat.shape[0])).reshape(num_shards, c)


def unrows(stacked: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The inverse of ``rows``: ``(N, c)`` to ``shape``, dropping the padding."""
    return jnp.reshape(stacked, (-1,))[: math.prod(shape)].reshape(shape)


def own_rows(tree: Any, axis_name: str, num_shards: int) -> Any:
    """Inside shard_map: this device's row ``(c_i,)`` of every leaf of ``tree`` (whole leaves, same on every device)."""
    index = jax.lax.axis_index(axis_name)
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(rows(x, num_shards), index, keepdims=False), tree)


def buckets(dtypes: Sequence[Any], nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Leaf indices grouped by dtype (tree order kept) and split so a bucket holds at most ``bucket_bytes`` (a larger
    leaf alone)."""
    groups: dict[Any, list[list[int]]] = {}
    totals: dict[Any, int] = {}
    for index, (dtype, size) in enumerate(zip(dtypes, nbytes)):
        key = jnp.dtype(dtype)
        if key not in groups or totals[key] + size > bucket_bytes:
            groups.setdefault(key, []).append([])
            totals[key] = 0
        groups[key][-1].append(index)
        totals[key] += size
    return [bucket for group in groups.values() for bucket in group]


def _split(joined: jax.Array, lengths: Sequence[int]) -> list[jax.Array]:
    """Columns of ``joined`` (``(..., sum lengths)``) cut into consecutive pieces of ``lengths``."""
    ends = np.cumsum(lengths)
    return [joined[..., end - length : end] for end, length in zip(ends, lengths)]


def reduce_scatter(
    grads: Any, axis_name: str, num_shards: int, *, average: bool, reduce_dtype: Any, bucket_bytes: int
) -> Any:
    """Inside shard_map: row r (this device's) of ``sum_d grads_d`` (``/ N`` when ``average``), a tree of ``(c_i,)``
    in the gradients' dtypes, summed in ``reduce_dtype`` (None: the gradients' dtype). One psum_scatter per bucket."""
    leaves, treedef = jax.tree.flatten(grads)
    dtypes = [jnp.dtype(reduce_dtype or leaf.dtype) for leaf in leaves]
    lengths = [row_length(leaf.size, num_shards) for leaf in leaves]
    nbytes = [num_shards * c * dtype.itemsize for c, dtype in zip(lengths, dtypes)]
    out: list[jax.Array | None] = [None] * len(leaves)
    for bucket in buckets(dtypes, nbytes, bucket_bytes):
        joined = jnp.concatenate([rows(leaves[i].astype(dtypes[i]), num_shards) for i in bucket], axis=1)
        summed = jax.lax.psum_scatter(joined, axis_name, scatter_dimension=0, tiled=True)[0]
        if average:
            summed = summed / num_shards
        for i, piece in zip(bucket, _split(summed, [lengths[i] for i in bucket])):
            out[i] = piece.astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)


def all_gather(row_tree: Any, like: Any, axis_name: str, num_shards: int, *, invariant: bool, bucket_bytes: int) -> Any:
    """Inside shard_map: whole leaves shaped like ``like`` from every device's rows ``row_tree`` (``(c_i,)`` each),
    in the rows' dtypes; one all_gather per bucket. ``invariant``: type the result as the same on every device."""
    leaves, treedef = jax.tree.flatten(row_tree)
    shapes = [leaf.shape for leaf in jax.tree.leaves(like)]
    lengths = [leaf.shape[0] for leaf in leaves]
    nbytes = [num_shards * leaf.nbytes for leaf in leaves]
    out: list[jax.Array | None] = [None] * len(leaves)
    for bucket in buckets([leaf.dtype for leaf in leaves], nbytes, bucket_bytes):
        joined = jnp.concatenate([leaves[i] for i in bucket])
        gathered = jax.lax.all_gather(joined, axis_name, tiled=True, to="invarying" if invariant else "varying")
        stacked = gathered.reshape(num_shards, joined.shape[0])
        for i, piece in zip(bucket, _split(stacked, [lengths[i] for i in bucket])):
            out[i] = unrows(piece, shapes[i])
    return jax.tree.unflatten(treedef, out)


# ---- checks ---------------------------------------------------------------------------------------------------


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) or "<root>" for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_same_shapes(what: str, tree: Any, like: Any) -> None:
    """Raises ValueError unless ``tree`` has ``like``'s structure and leaf shapes."""
    if jax.tree.structure(tree) != jax.tree.structure(like):
        raise ValueError(
            f"{what} do not have the params' tree structure:\n{jax.tree.structure(tree)}\n{jax.tree.structure(like)}"
        )
    for name, leaf, want in zip(_paths(tree), jax.tree.leaves(tree), jax.tree.leaves(like)):
        if tuple(leaf.shape) != tuple(want.shape):
            raise ValueError(f"{what} leaf {name} has shape {tuple(leaf.shape)} but the param has {tuple(want.shape)}")


def check_state_like(what: str, state: Any, expected: Any, hint: str) -> None:
    """Raises ValueError unless ``state`` has the structure, shapes and dtypes of ``expected`` (ShapeDtypeStructs)."""
    if jax.tree.structure(state) != jax.tree.structure(expected):
        raise ValueError(
            f"{what} has tree structure {jax.tree.structure(state)} but this optimizer and these params "
            f"need {jax.tree.structure(expected)}: was it {hint}?"
        )
    for name, leaf, want in zip(_paths(state), jax.tree.leaves(state), jax.tree.leaves(expected)):
        if tuple(jnp.shape(leaf)) != tuple(want.shape) or jnp.result_type(leaf) != want.dtype:
            raise ValueError(
                f"{what} leaf {name} is {jnp.result_type(leaf)}{list(jnp.shape(leaf))} but this optimizer "
                f"and these params need {want.dtype}{list(want.shape)}: was it {hint}?"
            )


# ---- state conversion ---------------------------------------------------------------------------------------------


def shard_params_like(params: Any, num_shards: int) -> Any:
    """ShapeDtypeStructs of one device's shard tree: leaf i becomes ``(c_i,)`` of its dtype."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct((row_length(math.prod(p.shape), num_shards),), p.dtype), params)


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """How each leaf of an optimizer state converts between its replicated form (``tx.init(params)``) and its sharded
    form (every leaf with a leading ``num_shards`` dimension).

    kinds, per state leaf: "workspace" (``(W,)`` <-> ``(N, W_shard)``, each param leaf's slice cut into rows),
    "per_param" (a leaf of param shape ``S`` <-> ``(N, c)``, as master weights), "same" (equal on every device).
    """

    num_shards: int
    full_template: Any
    shard_template: Any
    kinds: tuple[str, ...]
    full_layout: WorkspaceLayout
    shard_layout: WorkspaceLayout

    @classmethod
    def build(cls, tx: Any, params: Any, num_shards: int) -> StatePlan:
        shard_params = shard_params_like(params, num_shards)
        full_template = jax.eval_shape(tx.init, params)
        shard_template = jax.eval_shape(tx.init, shard_params)
        full_layout, shard_layout = WorkspaceLayout.of(params), WorkspaceLayout.of(shard_params)
        kinds = []
        for name, full, shard in zip(
            _paths(full_template), jax.tree.leaves(full_template), jax.tree.leaves(shard_template)
        ):
            if full.shape == (full_layout.total,) and shard.shape == (shard_layout.total,):
                kinds.append("workspace")
            elif shard.shape == (row_length(math.prod(full.shape), num_shards),):
                kinds.append("per_param")
            elif full.shape == shard.shape:
                kinds.append("same")
            else:
                raise ValueError(
                    f"optimizer state leaf {name} ({full.shape} for the params, {shard.shape} for a shard) "
                    f"is neither a workspace, per parameter, nor the same on every device: it cannot be "
                    f"sharded"
                )
        return cls(num_shards, full_template, shard_template, tuple(kinds), full_layout, shard_layout)

    def check_replicated(self, state: Any) -> Any:
        check_state_like(
            "replicated optimizer state", state, self.full_template, "made by this optimizer's init for these params"
        )
        return state

    def unshard(self, state: Any) -> Any:
        """Sharded -> replicated (see the class docstring)."""

        def convert(kind: str, leaf: jax.Array, full: jax.ShapeDtypeStruct) -> jax.Array:
            if kind == "workspace":
                row_views = jax.vmap(self.shard_layout.views)(leaf)  # per param leaf, (N, c_i)
                return self.full_layout.flatten([unrows(v, s) for v, s in zip(row_views, self.full_layout.shapes)])
            if kind == "per_param":
                return unrows(leaf, full.shape)
            return leaf[0]

        leaves = [
            convert(kind, leaf, full)
            for kind, leaf, full in zip(self.kinds, jax.tree.leaves(state), jax.tree.leaves(self.full_template))
        ]
        return jax.tree.unflatten(jax.tree.structure(self.full_template), leaves)

    def shard(self, state: Any) -> Any:
        """Replicated -> sharded (see the class docstring); padding holds zeros."""
        n = self.num_shards

        def convert(kind: str, leaf: jax.Array) -> jax.Array:
            if kind == "workspace":
                leaf_rows = [rows(v, n) for v in self.full_layout.views(leaf)]
                return jax.vmap(self.shard_layout.flatten)(leaf_rows)
            if kind == "per_param":
                return rows(leaf, n)
            return jnp.broadcast_to(leaf, (n, *jnp.shape(leaf)))

        leaves = [convert(kind, leaf) for kind, leaf in zip(self.kinds, jax.tree.leaves(state))]
        return jax.tree.unflatten(jax.tree.structure(self.shard_template), leaves)
