"""How a run spreads over devices: one mesh axis ``data`` over every device of every host.

The state is replicated and batches are sharded along their row axis, so the same code runs on one device,
several GPUs or a multi-host TPU slice (under plain sharded ``jit`` XLA inserts the gradient all-reduce). A
step that must see only its own device's rows (FFI custom calls, which XLA cannot partition) runs inside
``jax.shard_map`` over this mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.step import Batch

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A one-axis mesh over every device: replicated state, batches sharded along their row axis."""

    mesh: Mesh

    @classmethod
    def over_all_devices(cls) -> DataParallel:
        return cls(Mesh(np.asarray(jax.devices()), (DATA_AXIS,)))

    @property
    def num_shards(self) -> int:
        return self.mesh.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def rows_sharding(self, row_axis: int) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*([None] * row_axis), DATA_AXIS))

    def put_batch(self, local_batch: Batch, row_axis: int) -> dict[str, jax.Array]:
        """Assembles the global batch from every host's rows (this host's given as numpy)."""
        sharding = self.rows_sharding(row_axis)
        return {
            key: jax.make_array_from_process_local_data(sharding, value) for key, value in local_batch.items()
        }

    def replicate(self, tree: Any) -> Any:
        return jax.device_put(tree, self.replicated)
