"""A tiny harness task (linear regression, compiles in about a second) for end-to-end tests of resume, signals,
NaN and full-disk handling through `train.harness.training.run_training`: ``python -m helpers.toy_task FLAGS`` with
``PYTHONPATH=tests``.

Task flags: ``--eval-seconds S`` makes every evaluation print ``evaluating`` and take S seconds (so a test can
signal it mid-evaluation); ``--nan-lr-from K`` makes the learning rate NaN from step K + 1 on (the update of step
K + 1 writes NaN parameters while its loss is still finite); ``--linear-decay`` makes the learning rate GPT's and
BERT's schedule (warmup, then linear decay to 0 at --steps) instead of a constant.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from train.data.stream import EpochStream
from train.harness import cli
from train.harness import config as config_lib
from train.harness.config import TrainingConfig
from train.harness.optimizer import linear_warmup_decay
from train.harness.training import Quality, Task, TaskSetup, run_training

FEATURES = 4
ROWS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig(TrainingConfig):
    steps: int | None = 6
    lr: float = 0.05
    warmup_steps: int | None = 1
    log_every: int = 1
    checkpoint_every: int | None = 2
    eval_seconds: float = 0.0
    nan_lr_from: int | None = None
    linear_decay: bool = False


@dataclasses.dataclass
class ToyStream(EpochStream):
    seed: int = 0
    steps_per_epoch: int = 5

    def _plan_for(self, epoch: int) -> Sequence[Any]:
        return list(range(self.steps_per_epoch))

    def _batch(self, step: Any) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        rng = np.random.default_rng([self.seed, self.epoch, step])
        x = rng.normal(size=(1, ROWS, FEATURES)).astype(np.float32)
        y = x @ np.arange(1.0, FEATURES + 1, dtype=np.float32) + 0.5
        return {"x": x, "y": y, "mask": np.ones((1, ROWS), np.float32)}, {"examples": ROWS}


def loss_fn(variables, batch, rng):
    params = variables["params"]
    errors = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2 * batch["mask"]
    return jnp.sum(errors), jnp.sum(batch["mask"]), {"nll": jnp.sum(errors)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy_task")
    cli.add_training_arguments(parser)
    parser.add_argument("--eval-seconds", type=float)
    parser.add_argument("--nan-lr-from", type=int)
    parser.add_argument("--linear-decay", action="store_const", const=True)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None) -> ToyConfig:
    return config_lib.resolve(ToyConfig, {key: value for key, value in given.items() if value is not None}, saved, {})


def evaluate(seconds: float):
    def run(state, final: bool) -> list[dict[str, Any]]:
        if seconds:
            print("evaluating", file=sys.stderr, flush=True)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return [{"split": "valid", "loss": 1.0, "nll": 1.0}]

    return run


def setup(run, precision: str, parallel) -> TaskSetup:
    config = run.config
    nan_from = config.nan_lr_from

    base = (
        linear_warmup_decay(config.lr, config.warmup_steps, config.steps)
        if config.linear_decay
        else lambda count: jnp.float32(config.lr)
    )

    def learning_rate(count):
        return base(count) if nan_from is None else jnp.where(count >= nan_from, jnp.nan, base(count))

    shapes = {"x": ((1, ROWS, FEATURES), jnp.float32), "y": ((1, ROWS), jnp.float32), "mask": ((1, ROWS), jnp.float32)}
    return TaskSetup(
        init_variables=lambda key: {"params": {"w": jnp.zeros((FEATURES,)), "b": jnp.zeros(())}},
        init_rng=jax.random.PRNGKey(config.seed),
        loss_fn=loss_fn,
        stream=ToyStream(seed=config.seed),
        batch_shapes=[shapes],
        flops_fn=lambda batch_shapes: 2.0 * float(np.prod(batch_shapes["x"])),
        evaluate=evaluate(config.eval_seconds),
        learning_rate=learning_rate,
        steps=config.steps,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        model_signature={"toy": FEATURES},
        implementation="flax",  # a plain JAX model, no fused op
        model_name="toy",
        batch_record={"batch_size": ROWS, "grad_accum": 1},
        data_record={"source": "toy"},
        config_record=config.to_dict(),
    )


TASK = Task(
    name="toy",
    counted=("examples",),
    quality=Quality("loss", "loss", False, float("inf"), ".3f"),
    config_type=ToyConfig,
    build_parser=build_parser,
    resolve_config=resolve_config,
    check_config=lambda config: cli.check_ranges(config, at_least_one=("steps",)),
    setup=setup,
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_training(TASK, argv)


if __name__ == "__main__":
    raise SystemExit(main())
