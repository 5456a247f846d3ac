"""What ``python -m train.gpt`` shows at the end of a run: texts the model generates, and its perplexity next to
the perplexities that say whether it learned (a unigram model of the training tokens, which ignores context,
and on the synthetic corpus its entropy floor, the best any model can do)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax

from train.errors import UsageError
from train.gpt import data as gpt_data
from train.gpt import model as gpt_model
from train.gpt.config import GptConfig

SAMPLES_FILENAME = "samples.txt"
SAMPLE_SEED_OFFSET = 7919  # the samples' key is the run's seed folded with this, apart from init and dropout keys


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Generates ``len(prompts)`` texts from the current parameters (`train.gpt.model.sample_texts`), prints them
    and writes them to ``path``; deterministic in ``seed``."""

    model: nn.Module  # ls_jax's GPT-2 or the plain Flax one (`train.gpt.model.build_model`)
    tokenizer: gpt_data.Tokenizer
    prompts: tuple[str, ...]  # one per sample; "" starts a new document
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    path: Path

    @classmethod
    def from_config(cls, config: GptConfig, model: nn.Module, tokenizer: gpt_data.Tokenizer, run_dir: Path) -> Sampler:
        """``--samples`` texts cycling through ``--prompt`` (default: new documents).

        Raises:
          UsageError: a prompt and ``--sample-tokens`` together need more than the model's positions, or
            ``--top-k`` exceeds the vocabulary.
        """
        vocab_size = model.config.vocab_size
        if config.top_k is not None and config.top_k > vocab_size:
            raise UsageError(f"--top-k {config.top_k} exceeds the model's {vocab_size} tokens")
        given = config.prompt or [""]
        prompts = tuple(given[i % len(given)] for i in range(config.samples))
        positions = model.max_positions
        for prompt in dict.fromkeys(prompts):
            length = 1 + len(tokenizer.encode([prompt])[0])  # the end-of-document id opens every prompt
            if length + config.sample_tokens > positions:
                raise UsageError(
                    f"--prompt {prompt!r} is {length} tokens (an end-of-document id first); with "
                    f"--sample-tokens {config.sample_tokens} that is more than the model's "
                    f"{positions} positions; shorten the prompt or lower --sample-tokens"
                )
        return cls(
            model,
            tokenizer,
            prompts,
            config.sample_tokens,
            config.temperature,
            config.top_k,
            config.seed,
            run_dir / SAMPLES_FILENAME,
        )

    def generate(self, variables: Any) -> list[str]:
        if not self.prompts:
            return []
        rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), SAMPLE_SEED_OFFSET)
        return gpt_model.sample_texts(
            self.model,
            variables,
            self.tokenizer,
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            rng=rng,
            temperature=self.temperature,
            top_k=self.top_k,
        )

    def describe(self) -> str:
        top_k = "all tokens" if self.top_k is None else f"top-k {self.top_k}"
        return f"temperature {self.temperature:g}, {top_k}, at most {self.max_new_tokens} new tokens each"

    def write(self, texts: Sequence[str]) -> str:
        """Writes the samples to ``path`` and returns the same text."""
        blocks = [f"# {len(texts)} samples, {self.describe()}\n"]
        for number, (prompt, text) in enumerate(zip(self.prompts, texts), 1):
            opening = f"prompt {prompt!r}" if prompt else "a new document"
            blocks.append(f"--- sample {number}, {opening} ---\n{text}\n")
        content = "".join(blocks)
        self.path.write_text(content, encoding="utf-8")
        return content


def perplexity_line(records: Sequence[Mapping[str, Any]], baselines: Mapping[str, float]) -> str:
    """``valid perplexity P; <baseline> B; ...``: the evaluation next to the data's reference perplexities."""
    scores = ", ".join(f"{r['split']} perplexity {r['perplexity']:.3f}" for r in records)
    names = {
        "unigram_perplexity": "a unigram model of the training tokens (no context)",
        "entropy_floor_perplexity": "the synthetic corpus's entropy floor (the best possible)",
    }
    references = [f"{names[key]} {baselines[key]:.3f}" for key in names if key in baselines]
    return "; ".join([scores, *references])


@dataclasses.dataclass(frozen=True)
class FinalReport:
    """Prints the perplexity against the baselines, and the samples (also written to the run directory)."""

    sampler: Sampler
    baselines: Mapping[str, float]

    def __call__(self, variables: Any, records: Sequence[Mapping[str, Any]]) -> None:
        texts = self.sampler.generate(variables)  # every host computes them; process 0 reports
        if jax.process_index() != 0:
            return
        print(perplexity_line(records, self.baselines))
        if texts:
            print(f"\nsamples, also in {self.sampler.path}:\n{self.sampler.write(texts)}")
