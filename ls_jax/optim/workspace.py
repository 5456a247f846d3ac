"""The optimizer workspace: every moment of every parameter leaf in one flat, contiguous f32 buffer.

A ``WorkspaceLayout`` is static (Python ints, derived from leaf shapes only): leaf ``i`` of the flattened
parameter tree (``jax.tree.leaves`` order) occupies ``buffer[offsets[i] : offsets[i] + sizes[i]]`` in row-major
order, and every offset is a multiple of ``ALIGN_ELEMENTS`` f32 elements (16 bytes) so that a kernel can use
16-byte vector accesses from the start of every leaf. The padding between leaves holds zeros and stays zero.

The same layout indexes every moment buffer, so one (offset, size) table serves a multi-tensor kernel that
updates all leaves in one launch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

ALIGN_ELEMENTS = 4
PARAM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) or "<root>" for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_leaves(kind: str, tree: Any) -> list[jax.Array]:
    """The leaves of ``tree``; raises ValueError naming the first one that is not f32, bf16 or f16."""
    leaves = jax.tree.leaves(tree)
    for index, leaf in enumerate(leaves):
        if jnp.dtype(leaf.dtype) not in PARAM_DTYPES:
            name = _leaf_names(tree)[index]
            raise ValueError(f"{kind} leaf {name} has dtype {leaf.dtype}; expected float32, bfloat16 or float16")
    return leaves


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    """Where each leaf lives in a flat workspace buffer.

    Attributes:
      shapes: the shape of every leaf, in ``jax.tree.leaves`` order.
      offsets: first element of each leaf in the buffer, a multiple of ``ALIGN_ELEMENTS``.
      sizes: number of elements of each leaf.
      total: length of the buffer (the last leaf padded to ``ALIGN_ELEMENTS``).
    """

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int

    @classmethod
    def from_shapes(cls, shapes: Sequence[Sequence[int]]) -> WorkspaceLayout:
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        sizes = tuple(math.prod(shape) for shape in shapes)
        offsets, cursor = [], 0
        for size in sizes:
            offsets.append(cursor)
            cursor += -(-size // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        return cls(shapes, tuple(offsets), sizes, cursor)

    @classmethod
    def of(cls, tree: Any) -> WorkspaceLayout:
        """The layout of a pytree of arrays (or of ``jax.ShapeDtypeStruct``s)."""
        return cls.from_shapes([leaf.shape for leaf in jax.tree.leaves(tree)])

    def zeros(self) -> jax.Array:
        return jnp.zeros((self.total,), jnp.float32)

    def flatten(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """Concatenates ``leaves`` (any float dtype) into one f32 buffer of this layout, zeros in the padding."""
        if len(leaves) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} leaves for this workspace, got {len(leaves)}")
        pieces = []
        for leaf, size, offset, end in zip(leaves, self.sizes, self.offsets, (*self.offsets[1:], self.total)):
            pieces.append(leaf.reshape(-1).astype(jnp.float32))
            if end - offset > size:
                pieces.append(jnp.zeros((end - offset - size,), jnp.float32))
        if not pieces:
            return self.zeros()
        return jnp.concatenate(pieces)

    def views(self, buffer: jax.Array) -> list[jax.Array]:
        """Each leaf's slice of ``buffer``, reshaped to the leaf's shape (f32)."""
        return [
            jax.lax.slice(buffer, (offset,), (offset + size,)).reshape(shape)
            for shape, offset, size in zip(self.shapes, self.offsets, self.sizes)
        ]

    def check_buffer(self, name: str, buffer: jax.Array) -> None:
        """Raises ValueError unless ``buffer`` is an f32 vector of this layout's length."""
        if tuple(buffer.shape) != (self.total,) or buffer.dtype != jnp.float32:
            raise ValueError(
                f"optimizer state {name} is {buffer.dtype}{list(buffer.shape)} but these parameters need a float32"
                f"[{self.total}] workspace ({len(self.shapes)} leaves); was the state initialized for other parameters?"
            )
