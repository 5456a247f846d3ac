"""The CUDA implementation of ``_engine.xla_step``: one multi-tensor kernel launch over all leaves.

The FFI target ``ls_optim_step`` (ffi_kernels/csrc/optim.cu) takes

    operands: scalars f32[S], grads[N], params[N] (when has_params), moments f32[workspace] x K,
              master f32[workspace] (with master weights)
    results:  outputs[N] (new params or updates), new moments x K, the new master (with master weights), and
              with clipping f32[NORM_PARTIALS] scratch

and finds each leaf's workspace offset from the leaf sizes with the rule of ``WorkspaceLayout``. Moments are
aliased to their results, and so are the params when the results are the new params, so under ``jax.jit``
with donated arguments the update is in place. So is the master copy. Global-norm clipping adds one reduction launch that writes
per-block partial sums into the scratch result; the update launch reduces them in a fixed order, so the
result is deterministic.
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


def step(config, grads, params, moments, scalars, master):
    """``_engine.xla_step``'s contract, computed by the ``ls_optim_step`` kernel."""
    num_leaves, num_moments = len(grads), len(moments)
    has_params = params is not None
    write_params = config.output == "params"
    workspaces = (*moments, *(() if master is None else (master,)))
    operands = [scalars, *grads, *(params if has_params else ()), *workspaces]
    result_types = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in zip(config.layout.shapes, config.out_dtypes)]
    result_types += [jax.ShapeDtypeStruct(buffer.shape, jnp.float32) for buffer in workspaces]
    if config.clip:
        result_types.append(jax.ShapeDtypeStruct((NORM_PARTIALS,), jnp.float32))
    first_workspace = 1 + num_leaves * (2 if has_params else 1)
    aliases = {first_workspace + k: num_leaves + k for k in range(len(workspaces))}
    if write_params and has_params:
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
        master=master is not None,
        decay=np.asarray(config.decay, np.int32),
    )
    new_master = None if master is None else results[num_leaves + num_moments]
    return list(results[:num_leaves]), tuple(results[num_leaves : num_leaves + num_moments]), new_master
