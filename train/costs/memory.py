"""Memory anatomy of a training step: where the bytes of one device go, against the measured peak.

    params + optimizer state (master weights, moments) + temporaries (gradients, activations kept for the
    backward, workspaces) ~ peak

Parameters and optimizer state are the train state's arrays; gradients have the params' shapes in f32 (the step
sums them in f32 and the optimizer reads them so, `train.harness.step`); temporaries are XLA's buffer assignment of
the compiled step (``memory_analysis()``). Inside one jitted step the gradients are temporaries, so their bytes are
reported as a part of the temporaries and are not added to the total a second time. Bytes per parameter are set
against the rule for mixed-precision AdamW: 16-bit params (2) and grads (2), f32 master weights (4) and two f32
moments (8), 16 bytes, plus about 2 for activations at small batch: 18 bytes/param.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

RULE_BYTES_PER_PARAM = 18


def device_bytes(leaf: Any) -> int:
    """Bytes of ``leaf`` on one device: its first local shard for a sharded jax.Array, else all of it."""
    shards = getattr(leaf, "addressable_shards", None)
    shape = shards[0].data.shape if shards else leaf.shape
    return int(np.prod(shape) * np.dtype(leaf.dtype).itemsize)


def tree_bytes(tree: Any) -> int:
    return sum(device_bytes(leaf) for leaf in jax.tree.leaves(tree))


def optimizer_bytes(opt_state: Any) -> tuple[int, int]:
    """(master weights, the rest: moments, previous gradients, counters) of an optimizer state, by the names on the
    path to each leaf (ls_jax.optim keeps master weights under ``master``)."""
    master = rest = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        size = device_bytes(leaf)
        if "master" in jax.tree_util.keystr(path):
            master += size
        else:
            rest += size
    return master, rest


def anatomy(params: Any, opt_state: Any, analysis: Any | None, measured_peak: int | None) -> dict[str, Any]:
    """The memory anatomy of one device (a sharded optimizer state counts its local shard): bytes of each part,
    bytes per parameter, and XLA's and the measured peak. ``analysis`` is a compiled step's ``memory_analysis()``
    (None where XLA gives none)."""
    count = int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))
    param_bytes = tree_bytes(params)
    grad_bytes = count * np.dtype(np.float32).itemsize
    master, moments = optimizer_bytes(opt_state)
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    xla_peak = None if analysis is None else int(getattr(analysis, "peak_memory_in_bytes", 0)) or None
    parts = {
        "params_bytes": param_bytes,
        "optimizer_master_bytes": master,
        "optimizer_moments_bytes": moments,
        "temporaries_bytes": temp,
    }
    total = None if temp is None else sum(parts.values())  # the gradients are inside the temporaries
    per_param = lambda value: None if value is None or count == 0 else value / count  # noqa: E731
    return {
        "param_count": count,
        **parts,
        "grads_bytes": grad_bytes,
        "total_bytes": total,
        "xla_peak_bytes": xla_peak,
        "measured_peak_bytes": measured_peak,
        "bytes_per_param": per_param(total),
        "state_bytes_per_param": per_param(param_bytes + grad_bytes + master + moments),
        "measured_bytes_per_param": per_param(measured_peak),
        "rule_bytes_per_param": RULE_BYTES_PER_PARAM,
    }


def describe(memory: dict[str, Any]) -> str:
    """One line: the parts in MiB and the bytes per parameter against the rule."""
    mib = lambda value: "n/a" if value is None else f"{value / 2**20:,.1f} MiB"  # noqa: E731
    ratio = lambda value: "n/a" if value is None else f"{value:.1f}"  # noqa: E731
    return (
        f"params {mib(memory['params_bytes'])}, optimizer {mib(memory['optimizer_master_bytes'])} master + "
        f"{mib(memory['optimizer_moments_bytes'])} moments, temporaries {mib(memory['temporaries_bytes'])} "
        f"(grads {mib(memory['grads_bytes'])} of them); {ratio(memory['bytes_per_param'])} B/param "
        f"({ratio(memory['state_bytes_per_param'])} for the state; rule {memory['rule_bytes_per_param']}), "
        f"measured peak {mib(memory['measured_peak_bytes'])}"
    )
