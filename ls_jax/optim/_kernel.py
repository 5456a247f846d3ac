"""The CUDA implementation of ``_engine.xla_step``: one multi-tensor kernel launch over all leaves.

The FFI target ``ls_optim_step`` (ffi_kernels/csrc/optim.cu) takes

    operands: scalars f32[S], grads[N], params[N] (when has_params), low halves int16[N] (with
              ``config.split_master``), moments f32[workspace] x K
    results:  outputs[N] (new params or updates; the new low halves with split_master), new moments x K,
              copies[N] (the new params in ``config.copy_dtypes``, with master weights), with clipping or
              ``config.norm`` f32[NORM_PARTIALS] scratch, and with ``config.norm`` the f32[] global norm

and finds each leaf's workspace offset from the leaf sizes with the rule of ``WorkspaceLayout``. Moments are
aliased to their results, and so are the params when the results are the new params (with split_master the
low halves to the outputs and the bf16 params to the copies), so under ``jax.jit`` with donated arguments the
update is in place. Global-norm clipping, or the norm asked for, adds one reduction launch that writes
per-block partial sums into the scratch result; the update launch reduces them in a fixed order, so the
result is deterministic, and its first block writes the norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "ls_optim_step"
NORM_PARTIALS = 1024
ALGORITHMS = {"adam": 0, "adam_nesterov": 1, "adan": 2}
MAX_LEAF_ELEMENTS = 2**31 - 1


def unsupported(config, grads, params) -> str | None:
    """Why the kernel cannot run this step, or None."""
    if not grads:
        return "there are no parameter leaves"
    largest = max(config.layout.sizes)
    if largest > MAX_LEAF_ELEMENTS:
        return f"a leaf of {largest} elements exceeds the kernel's limit of {MAX_LEAF_ELEMENTS} elements per leaf"
    return None


def varying_axes(x) -> frozenset:
    """The shard_map mesh axes along which ``x`` holds different values per device (empty outside shard_map)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _vary_together(operands: list) -> tuple[list, dict]:
    """Inside shard_map (vma checking on) an FFI call needs operands that vary along the same mesh axes, and declares
    its results' axes: the operands cast to vary along every axis any of them varies along (a ZeRO step's gradients,
    rows and moments all do; a replicated step inside shard_map may mix varying gradients with an invariant state),
    and the keyword arguments that give each result type those axes. Outside shard_map: unchanged, no arguments."""
    axes = frozenset().union(*(varying_axes(x) for x in operands))
    if not axes:
        return operands, {}
    cast = [
        x if varying_axes(x) == axes else jax.lax.pcast(x, tuple(sorted(axes - varying_axes(x))), to="varying")
        for x in operands
    ]
    aval = jax.typeof(cast[0])
    sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    return cast, {"sharding": sharding, "manual_axis_type": aval.manual_axis_type}


def step(config, grads, params, moments, scalars):
    """``_engine.xla_step``'s contract, computed by the ``ls_optim_step`` kernel."""
    num_leaves, num_moments = len(grads), len(moments)
    has_params = params is not None
    write_params = config.output == "params"
    if config.split_master:
        highs, lows = zip(*params)
        param_operands = [*highs, *lows]
    else:
        param_operands = list(params) if has_params else []
    operands, axes = _vary_together([scalars, *grads, *param_operands, *moments])
    result_types = [
        jax.ShapeDtypeStruct(shape, dtype, **axes) for shape, dtype in zip(config.layout.shapes, config.out_dtypes)
    ]
    result_types += [jax.ShapeDtypeStruct(moment.shape, jnp.float32, **axes) for moment in moments]
    result_types += [
        jax.ShapeDtypeStruct(shape, dtype, **axes) for shape, dtype in zip(config.layout.shapes, config.copy_dtypes)
    ]
    if config.clip or config.norm:
        result_types.append(jax.ShapeDtypeStruct((NORM_PARTIALS,), jnp.float32, **axes))
    if config.norm:
        result_types.append(jax.ShapeDtypeStruct((), jnp.float32, **axes))
    first_moment = 1 + num_leaves + len(param_operands)
    aliases = {first_moment + k: num_leaves + k for k in range(num_moments)}
    if config.split_master:
        aliases.update({1 + 2 * num_leaves + i: i for i in range(num_leaves)})
        aliases.update({1 + num_leaves + i: num_leaves + num_moments + i for i in range(num_leaves)})
    elif write_params:
        aliases.update({1 + num_leaves + i: i for i in range(num_leaves)})
    call = jax.ffi.ffi_call(TARGET, result_types, input_output_aliases=aliases, vmap_method="sequential")
    results = call(
        *operands,
        algorithm=np.int32(ALGORITHMS[config.algorithm]),
        num_leaves=np.int64(num_leaves),
        has_params=has_params,
        write_params=write_params,
        proximal=config.proximal,
        clip=config.clip,
        write_norm=config.norm,
        write_copies=bool(config.copy_dtypes),
        split_master=config.split_master,
        decay=np.asarray(config.decay, np.int32),
    )
    copies = list(results[num_leaves + num_moments : 2 * num_leaves + num_moments]) if config.copy_dtypes else None
    norm = results[-1] if config.norm else None
    return list(results[:num_leaves]), tuple(results[num_leaves : num_leaves + num_moments]), copies, norm
