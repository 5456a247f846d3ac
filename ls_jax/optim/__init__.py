"""Optax-compatible Adan, Adam and AdamW whose whole step is one fused multi-tensor update.

    tx = ls_jax.optim.adan(optax.warmup_cosine_decay_schedule(...), weight_decay=0.02, max_grad_norm=1.0)
    opt_state = tx.init(params)
    params, opt_state = ls_jax.optim.fused_apply(tx, grads, opt_state, params)      # or tx.update + apply_updates

Each transformation is a ``FusedGradientTransformation``: ``init`` / ``update`` as in optax (so it chains
with ``optax.chain``, ``optax.masked``, ``optax.inject_hyperparams``, ``optax.MultiSteps`` and works in a Flax
``TrainState``), plus ``apply``, which writes the new parameters in the same pass as the moments;
``fused_apply`` uses it when it can (see ``ls_jax.optim.base``). Numerically they are ``optax.adan`` /
``optax.adam`` / ``optax.adamw`` in f32, with two additions folded into the same pass: ``max_grad_norm``
(``optax.clip_by_global_norm``) and, for Adan, the paper's proximal weight decay and restarts.

Workspace. Each moment of all leaves lives in one flat f32 buffer (``workspace.WorkspaceLayout``: static
per-leaf offsets and sizes, each leaf starting 16-byte aligned). On CUDA with the ls_jax kernels
(``ls_jax.backend``), one kernel launch updates every leaf from a pointer table (plus one reduction launch
when clipping), in place when the jitted step donates params and optimizer state. Elsewhere (CPU, TPU, or
``LS_JAX_KERNELS=xla``) the same math runs in jax.numpy: each large leaf's moments are updated in place in the
workspaces and the small leaves' together (a few kernels per large leaf), then each leaf's new parameters; the
workspaces are indexed with 32-bit offsets there (unsigned past 2^31 elements), so at most 2^32 - 1 elements. Both
give the same
numbers, so checkpoints move freely between backends and devices. ``update`` returns the updates in each
parameter's dtype (the gradient's when called without params). The workspace is
one buffer per moment, replicated like the parameters under plain data parallelism; ``shard_optimizer`` (ZeRO-1,
``ls_jax.optim.sharded``) splits it, and the master weights, over the devices of a mesh axis instead.

16-bit storage (``storage_dtype=jnp.bfloat16`` or ``jnp.float16``; LightSeq's memory-saving mode). Params
and grads are kept in 16 bits, 2 + 2 bytes per parameter instead of 4 + 4 (grads where the caller keeps them so:
``fused_apply_scaled`` also reads f32 gradient sums), while the moments and every operation stay f32 (Adan: 20
instead of 24 bytes per parameter in total, AdamW: 12 instead of 16). The option states the contract: every
param leaf must already have that dtype and every gradient leaf that dtype or f32 (a ValueError names the one
that does not). The price is the precision of the parameters themselves: a
parameter is rounded to 16 bits after every step, so an update smaller than 2^-9 of its magnitude in bf16 (2^-12
in f16) is always lost and ones a few times larger are distorted. ``fused_apply`` rounds once (from the f32
result), where ``update`` + ``apply_updates`` rounds the update and then the sum. Adam-type steps have |u| of
about 1, so the relative update is about lr / |p|: lr 1e-3 on weights of magnitude 0.05 gives 2e-2, far above the
threshold (from-scratch Transformer training near its peak learning rate, LightSeq's fp16 WMT case: safe);
lr 1e-5 on the same weights gives 2e-4, below even f16's 2^-12 = 2.4e-4 (fine-tuning, or the tail of a
decaying schedule: most updates vanish). Keep f32 params there (``storage_dtype=None``, the default, which
accepts any mix of dtypes), or add master weights.

Master weights (``storage_dtype=jnp.bfloat16, master_weights=True``; mixed-precision training as in Apex's O2
and LightSeq2's trainer). The state (``MasterWeightsState``) adds f32 master weights. The step updates the master
in f32 and writes the 16-bit params from it in the same pass, so nothing is lost to rounding, and the model
computes with the 16-bit params directly: no per-step cast of every f32 weight, and 16-bit gradients. For bf16
params the state keeps only the low 16 bits of each master value, as the bf16 params are its high halves
(``ls_jax.optim.master``): 2 + 2 bytes per parameter for the params and master instead of 2 + 4, the master
exact all the same; ``master_params(state, params)`` gives the f32 values. ``init`` takes the f32 params (the
master starts exact); train with them cast to the storage dtype::

    tx = ls_jax.optim.adamw(1e-3, storage_dtype=jnp.bfloat16, master_weights=True)
    opt_state = tx.init(params)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

AdamW then moves 26 bytes per parameter per step with bf16 params (params and low halves, 2 + 2 read and
written, moments 8 + 8, 16-bit gradient 2) and 28 with f16 ones (f32 master read and written, gradient read and
params written), as with f32 params. ``update`` returns the f32 updates that ``optax.apply_updates`` turns into
the same 16-bit params ``apply`` writes.
"""

from ls_jax.optim import registry
from ls_jax.optim.adam import AdamState, adam, adamw
from ls_jax.optim.adan import AdanState, adan
from ls_jax.optim.base import FusedGradientTransformation, chain, fused_apply, fused_apply_scaled
from ls_jax.optim.gradient_sync import GradientSync
from ls_jax.optim.master import MasterWeightsState, master_params
from ls_jax.optim.sharded import ShardedOptimizer, shard_optimizer
from ls_jax.optim.workspace import WorkspaceLayout

__all__ = [
    "AdamState",
    "AdanState",
    "FusedGradientTransformation",
    "GradientSync",
    "MasterWeightsState",
    "ShardedOptimizer",
    "WorkspaceLayout",
    "adam",
    "adamw",
    "adan",
    "chain",
    "fused_apply",
    "fused_apply_scaled",
    "master_params",
    "registry",
    "shard_optimizer",
]
