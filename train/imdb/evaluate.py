"""Validation and test scores of the classification task: loss and accuracy over fixed batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from train.data import stream as data_lib
from train.data.stream import host_rows
from train.harness.parallel import DataParallel
from train.harness.step import TrainState
from train.imdb import data as imdb_data
from train.imdb.model import Classifier, classification_sums

# Batches dispatched before waiting for their sums. Unbounded, a fast host queues dozens of multi-device programs,
# and XLA's CPU client then deadlocks with several host devices: a device's queue holds at most 32 computations,
# and the thread launching the next one waits for room while the queue's head waits for that thread's device.
BATCHES_IN_FLIGHT = 4


class Evaluator:
    """Loss and accuracy on the evaluation splits, in batches of the training batch size (one more compiled shape).

    During training it scores the validation split (the test split when there is none); at the end every
    evaluation split.
    """

    def __init__(self, classifier: Classifier, data: imdb_data.PreparedData, batch_size: int, parallel: DataParallel):
        self.data, self.batch_size, self.parallel = data, batch_size, parallel
        self.splits = [name for name in imdb_data.SPLITS if name != "train" and name in data.splits]

        def sums(variables, batch):
            logits = classifier.logits(variables, batch["input_ids"], deterministic=True)
            return jnp.stack(classification_sums(logits, batch["labels"])).astype(jnp.float32)

        self._sums = jax.jit(sums, out_shardings=parallel.replicated)

    def evaluate_split(self, variables, name: str) -> dict[str, Any]:
        data = self.data.splits[name]
        totals = None
        for count, indices in enumerate(data_lib.fixed_eval_plan(len(data), self.batch_size), 1):
            local = host_rows(indices, jax.process_index(), jax.process_count())
            batch = self.parallel.put_batch(imdb_data.make_batch(data, local), row_axis=0)
            sums = self._sums(variables, batch)
            totals = sums if totals is None else totals + sums
            if count % BATCHES_IN_FLIGHT == 0:
                jax.block_until_ready(totals)
        loss, examples, correct = (float(value) for value in jax.device_get(totals))
        return {"split": name, "loss": loss / examples, "nll": loss / examples, "accuracy": correct / examples}

    def __call__(self, state: TrainState, final: bool) -> list[dict[str, Any]]:
        splits = self.splits if final else self.splits[:1]
        return [self.evaluate_split(state.variables, name) for name in splits]
