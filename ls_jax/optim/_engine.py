"""What the workspace optimizers (adan, adam, adamw) share: state, validation, the step and its dispatch.

One step, per element of every leaf, in f32 (``s`` are the per-step scalars, ``S`` the moment buffers):

    g       = c * grad,  or  (c * grad / ||c * grad||) * max_norm  when max_norm is set and ||c * grad|| >= max_norm
    S'      = moments(g, S, s)                            the algorithm (adan.py, adam.py)
    u       = direction(g, S', s)
    decoupled weight decay:  update = -lr * (u + wd * p),            new_p = p + update
    proximal weight decay:   new_p = (p - lr * u) / (1 + lr * wd),   update = new_p - p

``c`` is the gradient's scale (1 but in ``apply_scaled``, which also returns ``||c * grad||``), ``||.||`` the global
L2 norm over all leaves; ``wd`` applies to the leaves the mask selects, the others
take ``update = -lr * u``. Scalars (learning rate and weight decay from their schedules at the step count,
bias corrections, betas) are computed once per step in XLA and handed to the implementation as one f32 vector,
so hyperparameters may be traced values (``optax.inject_hyperparams``).

Implementations (XLA here; CUDA in ffi_kernels/csrc/optim.cu through ``_kernel.step``) share:
  step(grads, params, moments, scalars) -> (outputs, new_moments, copies, norm)
grads: list of leaves; params: list of leaves, or None when no leaf decays and updates are written; moments:
tuple of f32 workspace buffers; scalars: f32[len(config.scalar_names)]; outputs: the new parameters
(``config.output == "params"``) or the updates (``"updates"``), in ``config.out_dtypes``; norm: ``||c * grad||``
(f32 scalar) with ``config.norm``, else None.

With master weights, params are the master leaves, the outputs their new values, and the step also returns
``copies``: the new params rounded to ``config.copy_dtypes`` (the model's 16-bit params), written in the same pass;
copies is None without master weights. With ``config.split_master``
(bf16 params, see ``master.py``) each param is a pair (bf16 params, int16 low halves of the master), the outputs
are the new low halves and the copies the new params, rounded to nearest with ties away from zero.

One module on purpose: the state layout, the validation and the dispatch of one step change together, and
splitting them would scatter the single definition of the step the XLA and CUDA paths must both follow.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ls_jax import backend
from ls_jax.optim import _kernel
from ls_jax.optim import master as master_lib
from ls_jax.optim.base import FusedGradientTransformation
from ls_jax.optim.workspace import WorkspaceLayout, check_leaves

logger = logging.getLogger("ls_jax.optim")

COMMON_SCALARS = ("lr", "weight_decay", "max_norm", "grad_scale")
STORAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMALL_LEAF_ELEMENTS = 65536
MAX_XLA_WORKSPACE_ELEMENTS = 2**32 - 1
Moments = Callable[[jax.Array, Sequence[jax.Array], dict[str, jax.Array]], tuple[jax.Array, ...]]
Direction = Callable[[jax.Array, Sequence[jax.Array], dict[str, jax.Array]], jax.Array]


# ---- hyperparameter checks ----------------------------------------------------------------------------------


def _as_number(name: str, value: Any) -> float | None:
    """``value`` as a float, or None when it is traced (e.g. injected by ``optax.inject_hyperparams``)."""
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None


def check_nonnegative(name: str, value: Any, *, schedule_ok: bool = False) -> None:
    """Raises ValueError unless ``value`` is a number >= 0 (or, where allowed, a schedule)."""
    if callable(value):
        if schedule_ok:
            return
        raise ValueError(f"{name} must be a number, not a schedule")
    number = _as_number(name, value)
    if number is not None and not number >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_decay_rate(name: str, value: Any) -> None:
    """Raises ValueError unless ``value`` is in [0, 1)."""
    number = _as_number(name, value)
    if number is not None and not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_positive_int(name: str, value: Any) -> None:
    """Raises ValueError unless ``value`` is None or a positive integer."""
    if value is None:
        return
    number = _as_number(name, value)
    if number is not None and not (number >= 1 and number == int(number)):
        raise ValueError(f"{name} must be a positive integer or None, got {value}")


def check_options(max_grad_norm: Any, storage_dtype: Any, master_weights: bool) -> jnp.dtype | None:
    """Validates the options every workspace optimizer shares; returns the storage dtype (or None)."""
    if master_weights and storage_dtype is None:
        raise ValueError(
            "master_weights keeps an f32 copy of 16-bit params: it needs storage_dtype bfloat16 or float16"
        )
    if max_grad_norm is not None:
        number = _as_number("max_grad_norm", max_grad_norm)
        if number is not None and not number > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_grad_norm}")
    if storage_dtype is None:
        return None
    dtype = jnp.dtype(storage_dtype)
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be bfloat16, float16 or None, got {dtype}")
    return dtype


# ---- the step ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """An elementwise optimizer algorithm.

    Attributes:
      algorithm: the kernel's name for this math ("adan", "adam", "adam_nesterov").
      state_type: NamedTuple ``(count, *moment buffers)``.
      scalar_names: names of the per-step scalars ``scalars`` returns, in the kernel's order.
      scalars: step count (int32 scalar) -> dict of f32 scalars, computed exactly as optax computes them.
      moments: ``(g, moments, s) -> new_moments`` on f32 arrays, ``s`` the per-step scalars by name.
      direction: ``(g, new_moments, s) -> u``, the step direction from the updated moments.
      replaced: the moment buffers whose old values the other moments' updates read and whose new values do
        not come from their old ones (Adan's previous gradient); the XLA step writes them last (`_update_moments`).
    """

    algorithm: str
    state_type: type[NamedTuple]
    scalar_names: tuple[str, ...]
    scalars: Callable[[jax.Array], dict[str, Any]]
    moments: Moments
    direction: Direction
    replaced: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about one step: what the kernel is compiled and launched for. ``norm``: the step also
    returns the scaled gradient's global norm."""

    algorithm: str
    scalar_names: tuple[str, ...]
    layout: WorkspaceLayout
    decay: tuple[bool, ...]
    proximal: bool
    clip: bool
    output: Literal["params", "updates"]
    out_dtypes: tuple[np.dtype, ...]
    copy_dtypes: tuple[np.dtype, ...] = ()
    split_master: bool = False
    norm: bool = False


def _global_norm(leaves: list[jax.Array]) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))


def _clip_by_global_norm(leaves: list[jax.Array], norm: jax.Array, max_norm: jax.Array) -> list[jax.Array]:
    return [jnp.where(norm < max_norm, g, (g / norm) * max_norm) for g in leaves]


def clip_across_devices(leaves: Sequence[jax.Array], max_norm: Any, axis_name: str) -> list[jax.Array]:
    """Gradient leaves split over the devices of mesh axis ``axis_name`` (inside ``shard_map``), clipped by the norm
    of the whole gradient: ``||g|| = sqrt(psum_axis(sum_i sum(g_i^2)))`` and every element
    ``g if ||g|| < max_norm else (g / ||g||) * max_norm``, in f32 (the arithmetic the step's own clipping does).

    Returns f32 leaves of the input shapes; the step then runs without clipping of its own, on either path, so the
    kernel needs no cross-device reduction of its own."""
    g = [leaf.astype(jnp.float32) for leaf in leaves]
    local = sum((jnp.sum(x * x) for x in g), jnp.zeros([], jnp.float32))
    norm = jnp.sqrt(jax.lax.psum(local, axis_name))
    return [jnp.where(norm < max_norm, x, (x / norm) * max_norm) for x in g]


def _finish(config: StepConfig, u: jax.Array, p: jax.Array | None, decayed: bool, s: dict[str, jax.Array]):
    """The new parameter or the update of one leaf from its direction ``u`` (see the module docstring)."""
    lr = s["lr"]
    if p is None:
        return -lr * u
    p = p.astype(jnp.float32)
    if decayed and config.proximal:
        new_p = (p - lr * u) / (1.0 + lr * s["weight_decay"])
        return new_p if config.output == "params" else new_p - p
    update = -lr * (u + s["weight_decay"] * p) if decayed else -lr * u
    return p + update if config.output == "params" else update


def _offset_dtype(layout: WorkspaceLayout) -> np.dtype:
    """int32 for workspaces it can index, else uint32 (at most ``MAX_XLA_WORKSPACE_ELEMENTS`` elements).

    Not uint32 throughout: with unsigned offsets XLA on GPU no longer updated the last leaf's moments in place (for
    Transformer-big's 32768 x 1024 embedding, a 0.25 GiB temporary copy every step)."""
    if layout.total <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    if layout.total <= MAX_XLA_WORKSPACE_ELEMENTS:
        return np.dtype(np.uint32)
    raise ValueError(
        f"the XLA optimizer step indexes its workspaces with 32-bit unsigned offsets (at most "
        f"{MAX_XLA_WORKSPACE_ELEMENTS} elements); these parameters need {layout.total}"
    )


def _gather(buffer: jax.Array, index: jax.Array) -> jax.Array:
    """``buffer[index]`` for a sorted, unique ``index`` (jnp indexing would narrow a uint32 one to int32)."""
    numbers = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(
        buffer,
        index[:, None],
        numbers,
        (1,),
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _scatter(buffer: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """``buffer`` with ``buffer[index] = values`` for a sorted, unique ``index``."""
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
    )
    return jax.lax.scatter(
        buffer,
        index[:, None],
        values,
        numbers,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _outputs_and_copies(config: StepConfig, new: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array] | None]:
    """(outputs, copies) of the step from each leaf's new f32 params or updates ``new``."""
    if config.split_master:
        copies = [master_lib.round_to_bf16(x) for x in new]
        return [master_lib.low_half(x, high) for x, high in zip(new, copies)], copies
    outputs = [x.astype(dtype) for x, dtype in zip(new, config.out_dtypes)]
    copies = [x.astype(dtype) for x, dtype in zip(new, config.copy_dtypes)] if config.copy_dtypes else None
    return outputs, copies


def _update_moments(config: StepConfig, rule: Rule, g: list[jax.Array], moments, s) -> tuple[jax.Array, ...]:
    """The new moment workspaces from each leaf's gradient ``g[i]`` (flat f32), written over the old ones in place.

    Not over one flat gradient: concatenating hundreds of gradient leaves into a workspace-shaped buffer is a loop
    over its operands that XLA on GPU runs at a fraction of copy bandwidth. Instead each leaf of at least
    ``SMALL_LEAF_ELEMENTS`` updates its slices in place, and the small leaves (biases, LayerNorm) go together
    through one gather and one scatter, since on their own each would cost a kernel launch for a few kilobytes.
    The large leaves' offsets are traced values because XLA updates a buffer in place only where the update reads
    it through a dynamic slice at the same offsets; constant offsets become static slices, and each update a copy
    of the whole workspace.

    The ``rule.replaced`` buffers are written after an optimization barrier that every other update passes: a
    write that does not read the slice it replaces has no data dependence on the other moments' reads of it, and
    XLA on GPU then copied the whole workspace before such writes (Adan's step for BERT-base: 45 copies, 18 GiB).
    """
    layout = config.layout
    offset_dtype = _offset_dtype(layout)
    small = [i for i, size in enumerate(layout.sizes) if size < SMALL_LEAF_ELEMENTS]
    large = [i for i, size in enumerate(layout.sizes) if size >= SMALL_LEAF_ELEMENTS]
    offsets = jax.lax.optimization_barrier(jnp.asarray(layout.offsets, offset_dtype))
    kept = [k for k in range(len(moments)) if k not in rule.replaced]
    moments = list(moments)
    replacements = []  # (write, new value) per leaf group, for the replaced buffers
    for i in large:
        start = (offsets[i],)
        old = [jax.lax.dynamic_slice(m, start, g[i].shape) for m in moments]
        new = rule.moments(g[i], old, s)
        for k in kept:
            moments[k] = jax.lax.dynamic_update_slice(moments[k], new[k], start)
        replacements.append((functools.partial(_write_slice, start=start), new))
    if small:
        index = [np.arange(layout.offsets[i], layout.offsets[i] + layout.sizes[i], dtype=offset_dtype) for i in small]
        index = jnp.asarray(np.concatenate(index))
        new = rule.moments(jnp.concatenate([g[i] for i in small]), [_gather(m, index) for m in moments], s)
        for k in kept:
            moments[k] = _scatter(moments[k], index, new[k])
        replacements.append((functools.partial(_scatter, index=index), new))
    if rule.replaced:
        moments = list(jax.lax.optimization_barrier(tuple(moments)))
        for write, new in replacements:
            for k in rule.replaced:
                moments[k] = write(moments[k], values=new[k])
    return tuple(moments)


def _write_slice(buffer: jax.Array, *, values: jax.Array, start: tuple[jax.Array]) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, values, start)


def xla_step(config: StepConfig, rule: Rule, grads, params, moments, scalars):
    """The step in jax.numpy: the new moments in the workspaces, then each leaf's direction and update from its
    gradient and its slices of the new workspaces.

    The new moments pass an optimization barrier before the directions are computed from them, so each leaf's
    update reads its slices back from the new workspaces. Without the barrier XLA recomputes the moments inside
    the leaves' updates, and that fusion slows down with the number of leaves: without the barrier the step of
    Transformer-big 12e12d (367 leaves) took about twice as long; for 6e6d (187 leaves) the two are within 5%.
    """
    s = {name: scalars[i] for i, name in enumerate(config.scalar_names)}
    g = [leaf.reshape(-1).astype(jnp.float32) * s["grad_scale"] for leaf in grads]
    norm = _global_norm(g) if config.clip or config.norm else None
    if config.clip:
        g = _clip_by_global_norm(g, norm, s["max_norm"])
    new_moments = jax.lax.optimization_barrier(_update_moments(config, rule, g, moments, s))
    leaf_moments = zip(*(config.layout.views(m) for m in new_moments))
    if params is None:
        params = [None] * len(grads)
    elif config.split_master:
        params = [master_lib.join_halves(high, low) for high, low in params]
    new = [
        _finish(config, rule.direction(g_leaf.reshape(shape), m_leaf, s), p, decayed, s)
        for g_leaf, shape, m_leaf, p, decayed in zip(g, config.layout.shapes, leaf_moments, params, config.decay)
    ]
    outputs, copies = _outputs_and_copies(config, new)
    return outputs, tuple(new_moments), copies, norm if config.norm else None


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.warning("ls_jax.optim: running the XLA implementation on CUDA: %s", reason)


def run_step(config: StepConfig, rule: Rule, grads, params, moments, scalars):
    """The CUDA kernel when lowering for CUDA with kernels enabled and supported, else ``xla_step``."""
    xla = functools.partial(xla_step, config, rule)
    if not backend.kernels_enabled():
        return xla(grads, params, moments, scalars)
    reason = _kernel.unsupported(config, grads, params)
    if reason is not None:
        _log_fallback_once(reason)
        return xla(grads, params, moments, scalars)
    kernel = functools.partial(_kernel.step, config)
    return jax.lax.platform_dependent(grads, params, moments, scalars, cuda=kernel, default=xla)


# ---- the transformation -----------------------------------------------------------------------------------


def _at(value: Any, count: jax.Array) -> Any:
    return value(count) if callable(value) else value


def _decay_flags(weight_decay: Any, mask: Any, tree: Any, num_leaves: int) -> tuple[bool, ...]:
    """Per leaf, whether weight decay applies: False everywhere for a constant 0, else from ``mask``."""
    if isinstance(weight_decay, (int, float)) and weight_decay == 0:
        return (False,) * num_leaves
    if mask is None:
        return (True,) * num_leaves
    mask_tree = mask(tree) if callable(mask) else mask
    try:
        per_subtree = jax.tree.map(lambda flag, sub: [bool(flag)] * len(jax.tree.leaves(sub)), mask_tree, tree)
    except ValueError as err:
        raise ValueError(f"mask must be a pytree of booleans with the params' structure (or a prefix): {err}") from err
    flags = tuple(jax.tree.leaves(per_subtree))
    if len(flags) != num_leaves:
        raise ValueError(f"mask selects {len(flags)} leaves but the parameters have {num_leaves}")
    return flags


def _check_storage(kind: str, leaves: Sequence[jax.Array], dtype: jnp.dtype | None, *, f32_ok: bool = False) -> None:
    if dtype is None:
        return
    for leaf in leaves:
        if leaf.dtype != dtype and not (f32_ok and leaf.dtype == jnp.float32):
            found = f"{leaf.dtype}{list(leaf.shape)}"
            allowed = f"{dtype} or float32" if f32_ok else str(dtype)
            raise ValueError(f"storage_dtype={dtype} needs every {kind} leaf in {allowed}, found {found}")


def _check_master(leaves: Sequence[jax.Array], storage_dtype: jnp.dtype) -> None:
    expected = master_lib.master_dtype(storage_dtype)
    for leaf in leaves:
        if leaf.dtype != expected:
            found = f"{leaf.dtype}{list(leaf.shape)}"
            raise ValueError(
                f"with {storage_dtype} params the master weights are {expected} leaves (see "
                f"ls_jax.optim.master), found {found}: was the state made by this optimizer's init?"
            )


def _check_params_match(grads: Any, params: Any, layout: WorkspaceLayout) -> None:
    if jax.tree.structure(grads) != jax.tree.structure(params):
        structures = f"{jax.tree.structure(grads)}\n{jax.tree.structure(params)}"
        raise ValueError(f"gradients and params have different tree structures:\n{structures}")
    for index, (param, shape) in enumerate(zip(jax.tree.leaves(params), layout.shapes)):
        if tuple(param.shape) != shape:
            raise ValueError(f"param leaf {index} has shape {tuple(param.shape)} but its gradient has {shape}")


def _pack(names: Sequence[str], values: dict[str, Any]) -> jax.Array:
    return jnp.stack([jnp.asarray(values[name], jnp.float32) for name in names])


def workspace_transformation(
    rule: Rule,
    *,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule,
    mask: Any,
    proximal: bool,
    max_grad_norm: float | None,
    storage_dtype: jnp.dtype | None,
    master_weights: bool,
) -> FusedGradientTransformation:
    """The optax-compatible transformation (``init``, ``update``, fused ``apply``) of ``rule``."""
    moment_names = rule.state_type._fields[1:]
    scalar_names = COMMON_SCALARS + rule.scalar_names

    def init(params):
        leaves = check_leaves("param", params)
        if not master_weights:
            _check_storage("param", leaves, storage_dtype)
        layout = WorkspaceLayout.of(params)
        state = rule.state_type(jnp.zeros([], jnp.int32), *(layout.zeros() for _ in moment_names))
        if master_weights:
            return master_lib.MasterWeightsState(state, master_lib.initial_master(params, storage_dtype))
        return state

    def step(grads, state, params, output, grad_norm_axis, mask_params, grad_scale=1.0, norm=False):
        """(outputs, new state, norm): the new params or the updates, as ``output`` says; with master weights always
        the new 16-bit params (the copies of the new master); with ``norm`` the global norm of ``grad_scale * grads``,
        else None. ``grad_norm_axis`` and ``mask_params``: see ``apply``."""
        master = None
        if master_weights:
            if not isinstance(state, master_lib.MasterWeightsState):
                raise TypeError(f"expected a MasterWeightsState from this optimizer's init, got {type(state).__name__}")
            state, master = state
        if not isinstance(state, rule.state_type):
            expected, got = rule.state_type.__name__, type(state).__name__
            raise TypeError(f"expected a {expected} from this optimizer's init, got {got}")
        grad_leaves = check_leaves("gradient", grads)
        _check_storage("gradient", grad_leaves, storage_dtype, f32_ok=True)
        layout = WorkspaceLayout.of(grads)
        for name in moment_names:
            layout.check_buffer(name, getattr(state, name))
        decay_tree = mask_params if mask_params is not None else grads if params is None else params
        decay = _decay_flags(weight_decay, mask, decay_tree, len(grad_leaves))
        if params is None:
            if master_weights:
                raise ValueError("with master_weights the step needs the params: call update(grads, state, params)")
            if any(decay):
                raise ValueError("weight decay needs the params: call update(grads, state, params)")
            param_leaves = None
        else:
            _check_params_match(grads, params, layout)
            param_leaves = check_leaves("param", params)
            _check_storage("param", param_leaves, storage_dtype)
        copy_dtypes, split_master = (), False
        if master_weights:
            _check_params_match(grads, master, layout)
            master_leaves = jax.tree.leaves(master)
            _check_master(master_leaves, storage_dtype)
            copy_dtypes, split_master = tuple(leaf.dtype for leaf in param_leaves), master_lib.is_split(storage_dtype)
            param_leaves = list(zip(param_leaves, master_leaves)) if split_master else master_leaves
            output = "params"
            out_dtypes = tuple(leaf.dtype for leaf in master_leaves)
        else:
            out_dtypes = tuple(leaf.dtype for leaf in (param_leaves or grad_leaves))
        clip = max_grad_norm is not None
        if clip and grad_norm_axis is not None:
            grad_leaves, clip = clip_across_devices(grad_leaves, max_grad_norm, grad_norm_axis), False
        config = StepConfig(
            algorithm=rule.algorithm,
            scalar_names=scalar_names,
            layout=layout,
            decay=decay,
            proximal=proximal,
            clip=clip,
            output=output,
            out_dtypes=out_dtypes,
            copy_dtypes=copy_dtypes,
            split_master=split_master,
            norm=norm,
        )
        count = state.count
        values = {
            "lr": _at(learning_rate, count),
            "weight_decay": _at(weight_decay, count),
            "max_norm": 0.0 if max_grad_norm is None else max_grad_norm,
            "grad_scale": grad_scale,
            **rule.scalars(count),
        }
        moments = tuple(getattr(state, name) for name in moment_names)
        needed_params = param_leaves if output == "params" or any(decay) else None
        scalars = _pack(scalar_names, values)
        outputs, new_moments, copies, grad_norm = run_step(config, rule, grad_leaves, needed_params, moments, scalars)
        new_state = rule.state_type(optax.safe_increment(count), *new_moments)
        if master_weights:
            new_master = jax.tree.unflatten(jax.tree.structure(master), outputs)
            return copies, master_lib.MasterWeightsState(new_state, new_master), grad_norm
        return outputs, new_state, grad_norm

    def update(updates, state, params=None, *, grad_norm_axis=None, mask_params=None, **extra_args):
        del extra_args
        outputs, new_state, _ = step(updates, state, params, "updates", grad_norm_axis, mask_params)
        if master_weights:  # the updates that take the params to the new 16-bit copies, exact in f32
            outputs = [
                new.astype(jnp.float32) - old.astype(jnp.float32) for new, old in zip(outputs, jax.tree.leaves(params))
            ]
        return jax.tree.unflatten(jax.tree.structure(updates), outputs), new_state

    def apply(grads, state, params, *, grad_norm_axis=None, mask_params=None, **extra_args):
        """The new params and state. For a step on a part of each leaf (``ls_jax.optim.sharded``):
        ``grad_norm_axis`` names the mesh axis whose devices hold the other parts, so ``max_grad_norm`` clips by
        the norm over all of them, and ``mask_params`` is the tree of whole leaves a callable weight-decay mask is
        evaluated on (the parts keep their leaf's flag). Other keyword arguments are accepted and ignored."""
        del extra_args
        if params is None:
            raise ValueError("apply needs the params")
        outputs, new_state, _ = step(grads, state, params, "params", grad_norm_axis, mask_params)
        return jax.tree.unflatten(jax.tree.structure(params), outputs), new_state

    def apply_scaled(grads, state, params, grad_scale):
        """``apply`` on ``grad_scale * grads`` (the scale an f32 scalar, possibly traced), and that gradient's
        global norm before clipping, all in the step's one pass (on CUDA the clipping's reduction launch, run also
        without clipping)."""
        if params is None:
            raise ValueError("apply_scaled needs the params")
        outputs, new_state, grad_norm = step(grads, state, params, "params", None, None, grad_scale, True)
        return jax.tree.unflatten(jax.tree.structure(params), outputs), new_state, grad_norm

    return FusedGradientTransformation(init, update, apply, apply_scaled)
