"""Validation and test scores of the translation task: label-smoothed loss and BLEU (sacrebleu) of greedy or beam
decoding, in batches sized to the device's memory."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import sacrebleu

from ls_jax.models import TransformerConfig
from ls_jax.models.decoding import beam_search, greedy_decode
from train.costs import metrics as metrics_lib
from train.data import tokenizer as tokenizer_lib
from train.harness.parallel import DataParallel
from train.harness.step import TrainState
from train.wmt import data as wmt_data
from train.wmt.config import HOST_DECODE_MEMORY_MIB, WmtConfig
from train.wmt.model import Criterion, decode_row_bytes, decode_rows


def _gather_rows(array: jax.Array) -> np.ndarray:
    """A globally sharded array as one numpy array on every host."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _least_over_hosts(value: int) -> int:
    """The smallest of every host's ``value``: hosts must agree on batch shapes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


class Evaluator:
    """Validation (and, at the end, test) loss and BLEU of the current parameters.

    Each eval set is cut into batches of one fixed shape (rows, L) with L the set's longest padded example, so
    the loss and the decoder compile once per set; batches hold examples sorted by length so greedy decoding
    stops early.
    """

    def __init__(
        self,
        model: nn.Module,
        model_cfg: TransformerConfig,
        criterion: Criterion,
        data: wmt_data.PreparedData,
        config: WmtConfig,
        parallel: DataParallel,
    ):
        """``model``: ls_jax's Transformer of ``model_cfg`` or the plain Flax one of its shape (`build_model`)."""
        self.model, self.model_cfg, self.criterion = model, model_cfg, criterion
        self.data, self.config, self.parallel = data, config, parallel
        self.decode_len = model_cfg.layer.max_seq_len
        self._loss = jax.jit(self._loss_sums, out_shardings=parallel.replicated)

    def _loss_sums(self, variables, batch):
        logits = self.model.apply(variables, batch["src"], batch["tgt_in"], deterministic=True)
        return self.criterion(logits, batch["labels"])

    def _batches(self, data: wmt_data.ParallelData, limit: int | None, decoding: bool = False):
        """(global indices (rows,), device batch) over the first ``limit`` examples (all for None); for
        ``decoding``, batches small enough for the decoder's memory budget (`decode_rows`)."""
        count = len(data) if limit is None else min(limit, len(data))
        length, plan = wmt_data.eval_plan(
            data.example_lengths[:count],
            max_tokens=self.config.max_tokens,
            num_shards=self.parallel.num_shards,
            max_rows=self.decode_rows if decoding else None,
        )
        for indices in plan:
            local = wmt_data.host_rows(indices, jax.process_index(), jax.process_count())
            yield indices, self.parallel.put_batch(wmt_data.make_batch(data, local, length), row_axis=0)

    @functools.cached_property
    def decode_budget_bytes(self) -> int:
        """Device bytes a decoding batch may use: ``--decode-memory``, else half the memory free on the devices at
        the first evaluation (fixed from then on, so the decoder compiles once), the least over all hosts."""
        if self.config.decode_memory is not None:
            return self.config.decode_memory * 2**20
        free = metrics_lib.free_memory_bytes(jax.local_devices())
        return _least_over_hosts(HOST_DECODE_MEMORY_MIB * 2**20 if free is None else free // 2)

    def decode_rows(self, src_len: int) -> int:
        """Rows of ``src_len`` tokens per decoding batch: as many as the budget holds, at least one per device."""
        beams = self.config.beam_size if self.config.decode == "beam" else 1
        row_bytes = decode_row_bytes(self.model_cfg, src_len=src_len, decode_len=self.decode_len, beams=beams)
        return decode_rows(self.decode_budget_bytes, row_bytes, num_shards=self.parallel.num_shards)

    def _decode(self, variables, src: jax.Array) -> jax.Array:
        if self.config.decode == "beam":
            return beam_search(
                self.model,
                variables,
                src,
                beam_size=self.config.beam_size,
                max_len=self.decode_len,
                length_penalty=self.config.length_penalty,
            )
        return greedy_decode(self.model, variables, src, max_len=self.decode_len)

    def evaluate_split(self, variables, split: str, bleu_limit: int | None) -> dict[str, Any]:
        """Loss, NLL and (unless ``bleu_limit`` is 0) BLEU of the model's ``variables`` on ``split``."""
        data = self.data.eval_sets[split]
        loss_sum = nll_sum = tokens = 0.0
        for _, batch in self._batches(data, None):
            loss, nll, count = jax.device_get(self._loss(variables, batch))
            loss_sum, nll_sum, tokens = loss_sum + float(loss), nll_sum + float(nll), tokens + float(count)
        result = {"split": split, "loss": loss_sum / tokens, "nll": nll_sum / tokens, "bleu": None}
        if bleu_limit != 0:
            hypotheses = self.translate(variables, split, bleu_limit)
            references = self.data.references[split][: len(hypotheses)]
            result["bleu"] = sacrebleu.corpus_bleu(hypotheses, [references]).score
        return result

    def translate(self, variables, split: str, limit: int | None) -> list[str]:
        """The decoded translations of the first ``limit`` sentences of ``split`` (all for None), in order."""
        hypotheses: dict[int, str] = {}
        for indices, batch in self._batches(self.data.eval_sets[split], limit, decoding=True):
            output = _gather_rows(self._decode(variables, batch["src"]))
            texts = tokenizer_lib.decode(self.data.processor, output)
            hypotheses.update((int(i), text) for i, text in zip(indices, texts) if i >= 0)
        return [hypotheses[i] for i in sorted(hypotheses)]

    def __call__(self, state: TrainState, final: bool) -> list[dict[str, Any]]:
        """During training the validation split; at the end every evaluation split (valid, test)."""
        splits = list(self.data.eval_sets) if final else ["valid"]
        return [self.evaluate_split(state.variables, split, self.config.bleu_sentences) for split in splits]
