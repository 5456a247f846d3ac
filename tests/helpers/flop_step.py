"""One transformer-tiny training step compiled by the harness, with its analytic FLOP count, for the FLOP tests."""

import jax
import jax.numpy as jnp

from ls_jax.models import Transformer, TransformerConfig
from train.harness.optimizer import inverse_sqrt_schedule, make_optimizer
from train.harness.parallel import DATA_AXIS, DataParallel, StateLayout
from train.harness.step import TrainState, make_train_step
from train.harness.step_compiler import StepCompiler
from train.wmt import model as wmt_model

FLOP_TOLERANCE = 0.05  # XLA also counts elementwise work (softmax, LayerNorm, optimizer); matmuls dominate


def tiny_transformer_step(executables=None):
    """(compiler, state, batch, analytic FLOPs) of one transformer-tiny training step, fp32, batch 32 x 24, its rows
    shared by every device; the compiler keeps its steps in ``executables`` (None: nowhere)."""
    model_cfg = TransformerConfig.preset(
        "transformer-tiny",
        256,
        dtype=jnp.float32,
        hidden_dropout_ratio=0.0,
        attn_prob_dropout_ratio=0.0,
        activation_dropout_ratio=0.0,
    )
    model = Transformer(model_cfg)
    tx = make_optimizer("adamw", inverse_sqrt_schedule(1e-3, 10), weight_decay=0.0, clip_norm=None)
    tokens = jnp.ones((1, 8), jnp.int32)
    state = TrainState.create(
        model.init(jax.random.PRNGKey(0), tokens, tokens)["params"], tx, jax.random.PRNGKey(1), fp16=False
    )
    parallel = DataParallel.over_all_devices()
    compiler = StepCompiler(
        make_train_step(
            wmt_model.make_loss_fn(model, wmt_model.make_criterion("ls_jax", 0.1)), tx, axis_name=DATA_AXIS
        ),
        StateLayout(parallel),
        state,
        executables=executables,
    )
    shape = (1, 32, 24)
    batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name in ("src", "tgt_in", "labels")}
    analytic = wmt_model.make_flops_fn(model_cfg)({name: shape for name in batch})
    return compiler, state, batch, analytic
