"""The model side of ``python -m train.gpt``: configurations, the model of ``--implementation`` (ls_jax's GPT-2 or
the plain Flax one of `train.reference.zoo`), loss, FLOPs, evaluation, sampling, GPT-2 import.

Batches are those of `train.gpt.data`: ``input_ids`` and ``labels`` (rows, L), labels `IGNORE_LABEL` where no
loss is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.layers.config import replace_checked
from ls_jax.models import hf
from ls_jax.models.gpt import GPTConfig, GPTLMHeadModel
from ls_jax.ops import label_smoothed_cross_entropy
from train.costs.precision import PRECISION_DTYPES, fp8_gemms
from train.errors import UsageError
from train.gpt import data as gpt_data
from train.gpt.config import GptConfig, check_sequence_fits
from train.gpt.data import IGNORE_LABEL, HuggingFaceTokenizer, PackedRows
from train.harness import resume
from train.reference import from_ls_jax
from train.reference.losses import label_smoothed_sums
from train.reference.zoo import ReferenceGPT

Params = Any
Variables = Mapping[str, Any]  # Flax variables: "params" and, for an FP8 model, its scaling state
Batch = Mapping[str, jax.Array]


# ------------------------------------------------------------------------------------------------ configs


def preset_config(name: str, *, vocab_size: int, **layer_overrides: Any) -> GPTConfig:
    """`ls_jax.models.gpt` preset ``name`` (gpt2-tiny/small/medium/large) with the vocabulary and LayerConfig
    fields given (e.g. ``dtype``, ``max_seq_len``, dropout ratios).

    Raises:
      ValueError: an unknown preset (naming the valid ones) or field.
    """
    config = GPTConfig.preset(name, vocab_size=vocab_size)
    return dataclasses.replace(config, layer=replace_checked(config.layer, layer_overrides))


def build_model(implementation: str, model_cfg: GPTConfig) -> nn.Module:
    """ls_jax's GPT-2 of ``model_cfg``, or (``flax``) the plain Flax one of the same shape, dropout and dtype. Both
    take ``(input_ids, deterministic=...)``, decode with ``init_cache``/``decode`` and name their positions
    ``max_positions``.

    Raises:
      ValueError: the plain Flax GPT-2 cannot compute this model (another activation, dropout, normalization).
    """
    if implementation == "ls_jax":
        return GPTLMHeadModel(model_cfg)
    layer = model_cfg.layer
    if model_cfg.embedding_dropout not in (None, layer.hidden_dropout_ratio):
        raise ValueError(
            f"the plain Flax gpt cannot compute this model: embedding dropout "
            f"{model_cfg.embedding_dropout} (the reference's: the hidden dropout)"
        )
    return ReferenceGPT(
        from_ls_jax.zoo_config(layer, kind="gpt", vocab_size=model_cfg.vocab_size, num_layers=model_cfg.num_layers)
    )


def params_for(implementation: str, params: Params) -> Params:
    """ls_jax GPT-2 parameters (e.g. imported from Hugging Face) in the layout of ``implementation``'s model."""
    return params if implementation == "ls_jax" else from_ls_jax.gpt_params(params)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A Hugging Face GPT-2 directory loaded for training: its configuration, weights and tokenizer."""

    config: GPTConfig
    params: Params
    tokenizer: HuggingFaceTokenizer


def init_from(directory: str | Path, **layer_overrides: Any) -> Pretrained:
    """Loads a local Hugging Face GPT-2 directory (config.json, model.safetensors or pytorch_model.bin, and its
    tokenizer files) through `ls_jax.models.hf.load_pretrained`.

    Raises:
      FileNotFoundError: the directory, config.json or the weights are missing.
      ValueError: the directory holds another kind of model, or weights that do not fit its config.
      UsageError: the tokenizer files are missing.
    """
    config, params = hf.load_pretrained(directory, **layer_overrides)
    if not isinstance(config, GPTConfig):
        raise ValueError(f"a {type(config).__name__} checkpoint, not a GPT-2 model")
    tokenizer = HuggingFaceTokenizer.load(directory)
    if tokenizer.size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.size} tokens but the model only {config.vocab_size} embeddings")
    return Pretrained(config, params, tokenizer)


# ------------------------------------------------------------------------------------------------ loss


def lm_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed token NLL in f32, number of labels that count): logits (..., V), labels (...) with IGNORE_LABEL
    left out. Uses the fused cross-entropy op (a kernel on GPU that never writes f32 logits)."""
    _, nll_sum, count = label_smoothed_cross_entropy(logits, labels, epsilon=0.0, pad_id=IGNORE_LABEL)
    return nll_sum, count


def plain_lm_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`lm_sums` written with optax (`train.reference.losses`): the plain Flax baseline's criterion."""
    _, nll_sum, count = label_smoothed_sums(logits, labels, epsilon=0.0, ignore_label=IGNORE_LABEL)
    return nll_sum, count


LMSums = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
LM_SUMS: dict[str, LMSums] = {"ls_jax": lm_sums, "flax": plain_lm_sums}  # the criterion of each implementation


def make_loss_fn(
    model: nn.Module, sums: LMSums = lm_sums
) -> Callable[[Variables, Batch, jax.Array], tuple[jax.Array, jax.Array, dict]]:
    """The harness' ``loss_fn(variables, micro_batch, rng) -> (loss_sum, weight, sums)``: summed next-token NLL
    over the labels that count (by ``sums``), their number, and ``{"nll": loss_sum}``; dropout is drawn from
    ``rng``."""

    def loss_fn(variables, batch, rng):
        logits = model.apply(variables, batch["input_ids"], deterministic=False, rngs={"dropout": rng})
        nll_sum, count = sums(logits, batch["labels"])
        return nll_sum, count, {"nll": nll_sum}

    return loss_fn


# ------------------------------------------------------------------------------------------------ FLOPs


def gpt_train_flops(*, batch: int, seq_len: int, hidden: int, ffn: int, layers: int, vocab: int) -> int:
    """Matmul FLOPs of one training step of a decoder-only Transformer on (batch, seq_len) tokens.

    A multiply-add is 2 FLOPs and a training step is 3 forward passes (docs/flops.md). Per token of the forward:

        per layer   2 (4 H^2 + 2 H F)      Q, K, V, output projections and the feed-forward: 2 x its weights
                    + 4 L H                Q K^T and P V over all L keys (the causal half included: it is computed)
        logits      2 H V                  the tied output projection

    so a step costs  6 N t + 12 layers L H t + 6 H V t  for t = batch x seq_len tokens, N = layers (4H^2 + 2HF)
    the non-embedding weights: the familiar "6 x parameters x tokens" with the output projection counted among
    the parameters, plus attention's 12 layers L H per token. Biases, LayerNorm, softmax, GELU and the loss are
    elementwise and left out (XLA's count, which includes them, is a few percent higher).
    """
    tokens = batch * seq_len
    per_layer = 2 * (4 * hidden**2 + 2 * hidden * ffn) + 4 * seq_len * hidden
    return 3 * tokens * (layers * per_layer + 2 * hidden * vocab)


def make_flops_fn(config: GPTConfig) -> Callable[[Mapping[str, tuple[int, ...]]], int]:
    """The harness' ``flops_fn(batch_shapes)``: `gpt_train_flops` of a (grad_accum, rows, L) step."""
    layer = config.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> int:
        grad_accum, rows, seq_len = shapes["input_ids"]
        return grad_accum * gpt_train_flops(
            batch=rows,
            seq_len=seq_len,
            hidden=layer.hidden_size,
            ffn=layer.intermediate_size,
            layers=config.num_layers,
            vocab=config.vocab_size,
        )

    return flops


# ------------------------------------------------------------------------------------------------ evaluation


def perplexity(nll_per_token: float) -> float:
    """exp(mean NLL), inf where that overflows."""
    return math.exp(nll_per_token) if nll_per_token < 700 else math.inf


class Evaluator:
    """Loss and perplexity of the current parameters on held-out packed rows, in batches of ``rows`` rows.

    ``sums`` is the model's criterion (`LM_SUMS`); ``put_batch`` places a host's numpy batch on the devices (the
    harness' sharding; default: as is). ``__call__(state, final)`` returns one record per split: the validation
    split during training and at the end.
    """

    def __init__(
        self,
        model: nn.Module,
        splits: Mapping[str, PackedRows],
        rows: int,
        *,
        sums: LMSums = lm_sums,
        put_batch: Callable[[dict[str, np.ndarray]], Any] = lambda batch: batch,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.splits, self.rows, self.put_batch = splits, rows, put_batch
        self.process_index, self.process_count = process_index, process_count

        def batch_sums(variables, batch):
            return sums(model.apply(variables, batch["input_ids"], deterministic=True), batch["labels"])

        self._sums = jax.jit(batch_sums)

    def evaluate_split(self, variables: Variables, name: str) -> dict[str, Any]:
        """``{"split", "loss", "nll", "perplexity", "tokens"}``: mean NLL per label over every row of the split."""
        nll, tokens = 0.0, 0
        for batch in gpt_data.eval_batches(self.splits[name], self.rows, self.process_index, self.process_count):
            batch_nll, batch_tokens = jax.device_get(self._sums(variables, self.put_batch(batch)))
            nll, tokens = nll + float(batch_nll), tokens + int(batch_tokens)
        mean = nll / tokens
        return {"split": name, "loss": mean, "nll": mean, "perplexity": perplexity(mean), "tokens": tokens}

    def __call__(self, state: Any, final: bool) -> list[dict[str, Any]]:
        return [self.evaluate_split(state.variables, name) for name in self.splits if name != "train"]


# ------------------------------------------------------------------------------------------------ sampling


def _next_token(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """(B, V) logits -> (B,) ids: argmax for temperature 0, else a draw from softmax(logits / temperature)
    restricted to the ``top_k`` most probable ids (all for None; ids tied with the k-th stay in)."""
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k"))
def _generate(model, variables, prompt, rng, *, max_new_tokens, temperature, top_k):
    batch, prompt_len = prompt.shape
    _, cache = model.apply(variables, batch, prompt_len + max_new_tokens, method="init_cache", mutable=["cache"])
    logits, cache = model.apply({**variables, **cache}, prompt, method="decode", mutable=["cache"])

    def step(carry, key):
        cache, logits = carry
        token = _next_token(logits, key, temperature, top_k)
        logits, cache = model.apply({**variables, **cache}, token[:, None], method="decode", mutable=["cache"])
        return (cache, logits[:, 0]), token

    _, tokens = jax.lax.scan(step, (cache, logits[:, -1]), jax.random.split(rng, max_new_tokens))
    return tokens.T


def generate(
    model: nn.Module,
    variables: Variables,
    prompt: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> jax.Array:
    """``max_new_tokens`` ids continuing each row of ``prompt`` (B, P) by the model of Flax ``variables``,
    (B, max_new_tokens) int32.

    Incremental with the KV cache: the prompt runs once through the model, then each step feeds only the newest
    token. ``temperature`` 0 is greedy; otherwise tokens are drawn at that temperature from the ``top_k`` most
    probable (all for None), deterministic in ``rng``. Generation runs the full length; a caller cuts the text at
    the first end-of-document id.

    Raises:
      ValueError: an empty prompt, P + max_new_tokens beyond the model's positions, or a bad temperature/top_k.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    limit = model.max_positions
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(
            f"prompt must have shape (batch, length >= 1), got {prompt.shape}; start it with the "
            "end-of-document id for unprompted samples"
        )
    if max_new_tokens < 1 or prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} must be within the "
            f"model's {limit} positions (and max_new_tokens >= 1)"
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
        raise ValueError(f"top_k must be in [1, {model.config.vocab_size}], got {top_k}")
    return _generate(
        model, variables, prompt, rng, max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k
    )


def sample_texts(
    model: nn.Module,
    variables: Variables,
    tokenizer: gpt_data.Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> list[str]:
    """One continuation per prompt (a new document when the prompt is ""), as text: the prompt follows an
    end-of-document id, and the continuation stops at the next one. Each prompt is its own batch of one row."""
    texts = []
    for prompt, key in zip(prompts, jax.random.split(rng, len(prompts))):
        ids = [tokenizer.eos_id, *tokenizer.encode([prompt])[0]]
        new = np.asarray(
            generate(
                model,
                variables,
                np.asarray([ids]),
                max_new_tokens=max_new_tokens,
                rng=key,
                temperature=temperature,
                top_k=top_k,
            )
        )[0]
        ends = np.flatnonzero(new == tokenizer.eos_id)
        texts.append(tokenizer.decode(ids[1:] + list(new[: ends[0] if len(ends) else len(new)])))
    return texts


def layer_overrides(config: GptConfig, precision: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "dtype": PRECISION_DTYPES[precision],
        "fp8": fp8_gemms(precision),
        "remat": config.remat,
    }
    if config.dropout is not None:
        overrides.update(hidden_dropout_ratio=config.dropout, attn_prob_dropout_ratio=config.dropout)
    return overrides


def load_checkpoint(config: GptConfig, precision: str) -> Pretrained:
    """The --init-from checkpoint, its rows fitting its positions.

    Raises:
      UsageError: the directory holds another model, weights that do not fit, or too few positions.
    """
    directory = config.init_from
    try:
        pretrained = init_from(directory, **layer_overrides(config, precision))
    except ValueError as err:
        raise UsageError(f"--init-from {directory}: {err}") from err
    check_sequence_fits(
        config.max_seq_len, pretrained.config.layer.max_seq_len, f"the checkpoint {directory}", "lower --max-seq-len"
    )
    return pretrained


def model_signature(config: GptConfig, model_cfg: GPTConfig) -> dict[str, Any]:
    return resume.stack_signature(config, model_cfg.vocab_size, model_cfg.layer, model_cfg.num_layers)
