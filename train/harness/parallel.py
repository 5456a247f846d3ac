"""How a run spreads over devices: one mesh axis ``data`` over every device of every host.

Batches are sharded along their row axis and the training step runs inside ``jax.shard_map`` over the mesh
(`DataParallel.shard_step`), so every op, the FFI custom calls included (XLA cannot partition those: under plain
sharded ``jit`` it would all-gather their inputs and run each on the global batch), sees this device's rows only.
The same code runs on one device, several GPUs of one host, or many hosts.

The state is replicated, except with ZeRO-1 (``--shard-optimizer``, `StateLayout`): then the optimizer state is
split over the axis (``ls_jax.optim.shard_optimizer``). Checkpoints always hold the replicated ("saved") form, so
a run saved on N devices, with or without a sharded optimizer, resumes on M.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ls_jax.optim import ShardedOptimizer
from train.errors import UsageError
from train.harness.step import Batch, TrainState

DATA_AXIS = "data"


def initialize_distributed(heartbeat_timeout_s: int = 100) -> None:
    """Joins the job's processes with ``jax.distributed.initialize()``.

    JAX's runtime declares a process dead after ``heartbeat_timeout_s`` without its heartbeat, and a process that
    ends waits at most that long at the shutdown barrier for the others.

    On SLURM, Open MPI, Kubernetes and TPU VMs JAX finds the coordinator and this process's rank itself. On a
    plain machine or a cluster JAX does not know, the environment says it: ``JAX_COORDINATOR_ADDRESS`` (host:port
    of process 0), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; with one process per GPU each process sees its
    GPU through ``CUDA_VISIBLE_DEVICES`` or ``JAX_LOCAL_DEVICE_IDS``. CPU processes exchange collectives
    through gloo.
    """
    kwargs = process_counts(os.environ)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        **kwargs, heartbeat_timeout_seconds=heartbeat_timeout_s, shutdown_timeout_seconds=heartbeat_timeout_s
    )


def job_client() -> Any:
    """The key-value store client of this ``jax.distributed`` job (JAX has no public accessor for it)."""
    from jax._src import distributed

    return distributed.global_state.client


def from_process_zero(key: str, value: str, timeout_s: int = 300) -> str:
    """``value`` as process 0 has it, in every process of the job (through the job's key-value store); ``value``
    itself with one process. Every process must call it with the same ``key``."""
    if jax.process_count() == 1:
        return value
    if jax.process_index() == 0:
        job_client().key_value_set(f"ls_jax/{key}", value)
    return job_client().blocking_key_value_get(f"ls_jax/{key}", timeout_s * 1000)


def wait_for_processes(name: str, timeout_s: int = 300) -> None:
    """Returns once every process of the job has called it with ``name`` (no-op with one process)."""
    if jax.process_count() > 1:
        job_client().wait_at_barrier(f"ls_jax/{name}", timeout_s * 1000)


def process_counts(environ: Mapping[str, str]) -> dict[str, int]:
    """``num_processes`` and ``process_id`` from JAX_NUM_PROCESSES and JAX_PROCESS_ID where set, checked."""
    given = {
        key: environ[name]
        for key, name in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID"))
        if name in environ
    }
    try:
        counts = {key: int(value) for key, value in given.items()}
    except ValueError:
        raise UsageError(f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got {given}") from None
    if counts.get("num_processes", 1) < 1:
        raise UsageError(f"JAX_NUM_PROCESSES must be >= 1, got {counts['num_processes']}")
    if "process_id" in counts and not 0 <= counts["process_id"] < counts.get("num_processes", counts["process_id"] + 1):
        raise UsageError(
            f"JAX_PROCESS_ID {counts['process_id']} must be in 0 .. JAX_NUM_PROCESSES - 1 "
            f"({counts.get('num_processes')} processes): number the processes from 0"
        )
    return counts


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
        return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local_batch.items()}

    def replicate(self, tree: Any) -> Any:
        return jax.device_put(tree, self.replicated)

    def compiler_options(self) -> dict[str, Any]:
        """XLA options of the data-parallel step on several GPUs: the latency-hiding scheduler, which may run an
        asynchronous collective beside independent compute, and starting each collective as soon as its operand
        exists. Without the second, XLA issued every gradient bucket's all-reduce after the whole backward; with it,
        on two H200s (transformer-big), 15 of the backward's 124 matrix products ran after the first all-reduce
        started (`python -m train.bench schedule`). With bf16 gradients the step stayed the same (21.68 against
        21.72 ms, docs/results/README.md): little NCCL time was exposed either way. An option already named in
        ``$XLA_FLAGS`` is left to the user's value.
        """
        if self.num_shards == 1 or self.mesh.devices.flat[0].platform != "gpu":
            return {}
        options = {
            "xla_gpu_enable_latency_hiding_scheduler": True,
            "xla_gpu_experimental_collective_start_as_early_as_possible": True,
        }
        given = os.environ.get("XLA_FLAGS", "")
        return {name: value for name, value in options.items() if f"--{name}" not in given}

    def shard_step(self, step_fn: Callable, state_specs: Any) -> Callable:
        """``step_fn(state, batch) -> (state, metrics)`` run per device on its rows of the batch (axis 1)."""
        return jax.shard_map(
            step_fn,
            mesh=self.mesh,
            in_specs=(state_specs, PartitionSpec(None, DATA_AXIS)),
            out_specs=(state_specs, PartitionSpec()),
        )


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where each part of the train state lives, and its saved (checkpoint) form.

    Replicated: every leaf on every device. With ``sharded_optimizer`` the optimizer state's leaves have a leading
    dimension N split over the data axis (device r holds row r) and everything else is replicated.
    """

    parallel: DataParallel
    sharded_optimizer: ShardedOptimizer | None = None

    def _tree(self, state: TrainState, replicated: Any, sharded: Any) -> TrainState:
        return state.replace(
            step=replicated,
            params=replicated,
            rng=replicated,
            opt_state=sharded if self.sharded_optimizer is not None else replicated,
            loss_scale=None if state.loss_scale is None else replicated,
            scaling=None if state.scaling is None else replicated,
        )

    def specs(self, state: TrainState) -> TrainState:
        """A prefix tree of PartitionSpecs for ``state`` (``shard_map``'s in/out specs)."""
        return self._tree(state, PartitionSpec(), PartitionSpec(DATA_AXIS))

    def shardings(self, state: TrainState) -> TrainState:
        """A prefix tree of NamedShardings for ``state`` (``jit``'s in/out shardings)."""
        return self._tree(state, self.parallel.replicated, NamedSharding(self.parallel.mesh, PartitionSpec(DATA_AXIS)))

    def to_saved(self, state: TrainState) -> TrainState:
        """The replicated form of ``state`` (what a checkpoint holds): the sharded optimizer state gathered."""
        if self.sharded_optimizer is None:
            return state
        opt_state = self.sharded_optimizer.unshard_state(
            state.opt_state, state.params, out_sharding=self.parallel.replicated
        )
        return state.replace(opt_state=opt_state)

    def from_saved(self, saved: TrainState) -> TrainState:
        """The training form of a replicated ``saved`` state (the inverse of `to_saved`)."""
        if self.sharded_optimizer is None:
            return saved
        opt_state = self.sharded_optimizer.shard_state(
            saved.opt_state, saved.params, out_sharding=NamedSharding(self.parallel.mesh, PartitionSpec(DATA_AXIS))
        )
        return saved.replace(opt_state=opt_state)

    def saved_abstract(self, state: TrainState) -> TrainState:
        """Shapes, dtypes and (replicated) shardings of `to_saved` of ``state`` (arrays or their shapes), to restore a
        checkpoint onto."""
        abstract = jax.eval_shape(self.to_saved, state)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.parallel.replicated), abstract
        )
