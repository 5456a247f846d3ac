"""The Transformer training steps the end-to-end benchmarks compare, built three ways on the same batches.

Fixed-length 64-token source and target sentences, a shared 32768 vocabulary, dropout 0.1 everywhere, label
smoothing 0.1, AdamW, bf16 compute with f32 params:
  reference  train/reference/transformer.py, plain Flax linen + optax, all XLA; the f32 params are cast to bf16 for
             every use;
  ls_jax_xla ls_jax.models.Transformer + ls_jax.optim with every op on its XLA implementation; the f32 params
             are the optimizer's master weights (the bf16 params their high halves, the optimizer state their
             low halves), and its step writes the bf16 params the model computes with;
  ls_jax_ffi the same with the CUDA kernels.
With FP8 (``reference_fp8``, ``ls_jax_ffi_fp8``, named in ``--implementations`` only) every Dense, attention
projection and the tied logits multiply in FP8 with delayed scaling (plain Flax through Flax's
``Fp8DirectDotGeneralOp``, ls_jax through `ls_jax.layers.fp8`, which keeps Flax's scaling); the step carries
each GEMM's scaling state beside the params and takes its gradient as the next state.
The step's loss and optimizer run under the ``criterion`` and ``optimizer`` name scopes, which the kernel
attribution of `train.bench.tracing.kernel_trace` reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ls_jax.layers import fp8
from train.bench.steps import token_ids as token_ids_lib
from train.costs import metrics
from train.reference.losses import label_smoothed_sums
from train.reference.transformer import ReferenceConfig, ReferenceTransformer

VOCAB = 32768
SEQ_LEN = 64
LABEL_SMOOTHING = 0.1
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
FP8_IMPLEMENTATIONS = ("reference_fp8", "ls_jax_ffi_fp8")
IMPLEMENTATIONS = ("reference", "ls_jax_xla", "ls_jax_ffi", *FP8_IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    encoder_layers: int
    decoder_layers: int


MODELS = {
    "tiny-2e2d": ModelShape(128, 256, 4, 2, 2),  # --quick only: a CPU smoke run of the whole benchmark
    "base-6e6d": ModelShape(512, 2048, 8, 6, 6),
    "big-6e6d": ModelShape(1024, 4096, 16, 6, 6),
    "big-12e12d": ModelShape(1024, 4096, 16, 12, 12),
    "big-24e24d": ModelShape(1024, 4096, 16, 24, 24),
}
QUICK_MODEL = "tiny-2e2d"
LS_JAX_PRESETS = {
    "tiny-2e2d": "transformer-tiny",
    "base-6e6d": "transformer-base",
    "big-6e6d": "transformer-big",
    "big-12e12d": "transformer-big-12e12d",
    "big-24e24d": "transformer-big-24e24d",
}


@dataclasses.dataclass
class TrainStep:
    """A train step compiled once for one batch shape, donating its state; ``run()`` advances the state."""

    compiled: Any
    state: Any
    lowered: Any = None
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def run(self, batch) -> jax.Array:
        self.state, loss = self.compiled(self.state, batch)
        return loss

    def recompiled(self, compiler_options: dict[str, Any]) -> TrainStep:
        """The same step compiled again with XLA ``compiler_options`` added to its own, on this step's state (which it
        donates)."""
        options = self.compiler_options | compiler_options
        return TrainStep(self.lowered.compile(compiler_options=options), self.state, self.lowered, options)

    def memory_bytes(self) -> int:
        """Device memory the step needs: arguments + outputs - donated aliases + temporaries (XLA's analysis)."""
        analysis = self.compiled.memory_analysis()
        return int(
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes
        )


LossFn = Callable[[Any, Any, jax.Array], jax.Array]
"""``loss_fn(variables, batch, dropout_rng) -> scalar loss`` of a benchmarked step; ``variables`` are Flax's:
``{"params": ...}`` plus, with FP8, the scaling collection."""


def compile_step(step: Callable[..., Any], state: Any, batch, fp8_gemms: bool = False) -> TrainStep:
    """``step(state, batch) -> (state, loss)`` compiled for ``batch``; with ``fp8_gemms``, under the options the
    training CLIs compile an FP8 step with (`fp8.compiler_options`)."""
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    options = fp8.compiler_options(jax.devices()[0].platform) if fp8_gemms else {}
    return TrainStep(lowered.compile(options), state, lowered, options)


def make_batch(num_sentences: int, seed: int, token_ids: str = token_ids_lib.DEFAULT) -> dict[str, jax.Array]:
    """Random ``src``, ``tgt_in`` and ``labels`` of (num_sentences, SEQ_LEN) tokens, ids drawn from ``token_ids``
    (`token_ids.DISTRIBUTIONS`) above the special ones; ``tgt_in`` is BOS + labels."""
    rng = np.random.default_rng(seed)
    tokens = lambda: jnp.asarray(token_ids_lib.draw(rng, (num_sentences, SEQ_LEN), 4, VOCAB, token_ids))  # noqa: E731
    target = tokens()
    bos = jnp.ones((num_sentences, 1), jnp.int32)
    return {"src": tokens(), "tgt_in": jnp.concatenate([bos, target[:, :-1]], axis=1), "labels": target}


def _value_and_grads(loss_fn: LossFn, params: Any, scaling: Any, batch, dropout_rng) -> tuple:
    """``(loss, param grads, next scaling state)``: the FP8 scaling collection's gradient is its next value."""
    loss_of = lambda params, scaling: loss_fn(fp8.with_scaling({"params": params}, scaling), batch, dropout_rng)  # noqa: E731
    loss, (grads, scaling_grads) = jax.value_and_grad(loss_of, argnums=(0, 1))(params, scaling)
    return loss, grads, fp8.new_scaling(scaling_grads)


def optax_adamw_step(loss_fn: LossFn, variables: Any, batch) -> TrainStep:
    """The plain Flax references' step: f32 params, optax AdamW; ``variables`` from the model's init."""
    tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    rest, scaling = fp8.split_scaling(variables)

    def step(state, batch):
        params, opt_state, rng, scaling = state
        rng, dropout_rng = jax.random.split(rng)
        loss, grads, scaling = _value_and_grads(loss_fn, params, scaling, batch, dropout_rng)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return (params, opt_state, rng, scaling), loss

    params = rest["params"]
    return compile_step(step, (params, tx.init(params), jax.random.PRNGKey(1), scaling), batch, bool(scaling))


def ls_jax_adamw_step(loss_fn: LossFn, variables: Any, batch) -> TrainStep:
    """ls_jax's step: ls_jax.optim AdamW over f32 master weights split into the bf16 params the model computes
    with and int16 low halves in the optimizer state; ``variables`` from the model's init."""
    from ls_jax import optim

    tx = optim.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY, storage_dtype=jnp.bfloat16, master_weights=True)
    rest, scaling = fp8.split_scaling(variables)
    opt_state = tx.init(rest["params"])
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), rest["params"])

    def step(state, batch):
        params, opt_state, rng, scaling = state
        rng, dropout_rng = jax.random.split(rng)
        loss, grads, scaling = _value_and_grads(loss_fn, params, scaling, batch, dropout_rng)
        with jax.named_scope("optimizer"):
            params, opt_state = optim.fused_apply(tx, grads, opt_state, params)
        return (params, opt_state, rng, scaling), loss

    return compile_step(step, (params, opt_state, jax.random.PRNGKey(1), scaling), batch, bool(scaling))


def reference_step(shape: ModelShape, batch, fp8_gemms: bool = False) -> TrainStep:
    cfg = ReferenceConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_heads=shape.heads,
        num_encoder_layers=shape.encoder_layers,
        num_decoder_layers=shape.decoder_layers,
        fp8=fp8_gemms,
    )
    model = ReferenceTransformer(cfg)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch["src"], batch["tgt_in"])

    def loss_fn(variables, batch, dropout_rng):
        logits = model.apply(variables, batch["src"], batch["tgt_in"], False, rngs={"dropout": dropout_rng})
        with jax.named_scope("criterion"):
            loss_sum, _, count = label_smoothed_sums(logits, batch["labels"], epsilon=LABEL_SMOOTHING, ignore_label=0)
        return loss_sum / count

    return optax_adamw_step(loss_fn, variables, batch)


def ls_jax_step(name: str, batch, layers_each: int | None = None, fp8_gemms: bool = False) -> TrainStep:
    from ls_jax import ops
    from ls_jax.models import PAD_ID, Transformer, TransformerConfig

    depth = {} if layers_each is None else {"num_encoder_layers": layers_each, "num_decoder_layers": layers_each}
    config = TransformerConfig.preset(
        LS_JAX_PRESETS[name], vocab_size=VOCAB, dtype=jnp.bfloat16, fp8=fp8_gemms, **depth
    )
    model = Transformer(config)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch["src"], batch["tgt_in"])

    def loss_fn(variables, batch, dropout_rng):
        logits = model.apply(
            variables, batch["src"], batch["tgt_in"], deterministic=False, rngs={"dropout": dropout_rng}
        )
        with jax.named_scope("criterion"):
            loss_sum, _, count = ops.label_smoothed_cross_entropy(
                logits, batch["labels"], epsilon=LABEL_SMOOTHING, pad_id=PAD_ID
            )
        return loss_sum / count

    return ls_jax_adamw_step(loss_fn, variables, batch)


def train_flops(name: str, sentences: int) -> float:
    """Matmul FLOPs of one step of model ``name`` on ``sentences`` source and target sentences."""
    shape = MODELS[name]
    return metrics.transformer_train_flops(
        hidden=shape.hidden,
        ffn=shape.intermediate,
        encoder_layers=shape.encoder_layers,
        decoder_layers=shape.decoder_layers,
        vocab=VOCAB,
        batch=sentences,
        src_len=SEQ_LEN,
        tgt_len=SEQ_LEN,
    )


def build_step(implementation: str, name: str, batch, layers_each: int | None = None) -> TrainStep:
    """The compiled step of ``implementation`` for model ``name`` (a key of MODELS) at ``batch``'s shape; with
    ``layers_each``, the model's widths with that many encoder and as many decoder layers."""
    fp8_gemms = implementation in FP8_IMPLEMENTATIONS
    if implementation.startswith("reference"):
        shape = MODELS[name]
        if layers_each is not None:
            shape = dataclasses.replace(shape, encoder_layers=layers_each, decoder_layers=layers_each)
        return reference_step(shape, batch, fp8_gemms)
    return ls_jax_step(name, batch, layers_each, fp8_gemms)


def kernel_mode(implementation: str) -> str:
    """The ls_jax backend an implementation runs under."""
    return "ffi" if implementation.startswith("ls_jax_ffi") else "xla"
