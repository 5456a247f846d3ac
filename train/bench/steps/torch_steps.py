"""The PyTorch reference of the end-to-end benchmark's BERT and GPT-2 rows: ``torch_compile``.

Hugging Face transformers' ``BertForSequenceClassification`` and ``GPT2LMHeadModel``, built from a transformers
config of the zoo model's shape (`zoo_steps.MODELS`; random init, nothing downloaded) with the plain Flax
reference's settings: dropout 0.1 on embeddings, sublayer outputs, attention probabilities and BERT's pooled
vector; exact GELU, LayerNorm eps 1e-12 and 2 labels for BERT; tanh GELU, LayerNorm eps 1e-5 and logits tied to the
token table for GPT-2; attention through transformers' "sdpa" (``torch.nn.functional.scaled_dot_product_attention``,
dropout per element). Parameters are float32 and the forward pass and loss run under bf16 autocast; the optimizer is
``torch.optim.AdamW`` (fused on CUDA) with the Flax steps' learning rate and weight decay. The whole step (forward,
loss, backward, optimizer step, zero_grad) runs under ``torch.compile`` in its default mode, which splits it where
Dynamo stops tracing: the forward pass and loss are one graph, ``loss.backward()`` runs its compiled backward graph,
and the optimizer's update is a graph of its own.

It runs on the GPU when PyTorch sees CUDA, else on the CPU. torch and transformers are imported only when a step is
built, so the rest of the benchmark runs where they are absent.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable

import numpy as np

from ls_jax.models import hf
from train.bench.steps import zoo_steps
from train.bench.steps.transformer_steps import LEARNING_RATE, WEIGHT_DECAY

MISSING = "the torch_compile row needs PyTorch and Hugging Face transformers ({reason}): pip install torch transformers"


def import_torch() -> tuple[Any, Any]:
    """``(torch, transformers)``; ImportError with the one-line ``MISSING`` where either is absent."""
    try:
        import torch
        import transformers
    except ImportError as err:
        raise ImportError(MISSING.format(reason=err)) from err
    return torch, transformers


def hf_config(name: str):
    """The transformers BertConfig or GPT2Config of zoo model ``name``: ls_jax's model of it
    (`zoo_steps.ls_jax_config`) as `ls_jax.models.hf.config_to_hf` exports it, with attention through "sdpa"; GPT-2
    keeps no key/value cache and takes its last id as BOS and EOS, as GPT-2's own vocabulary does."""
    _, transformers = import_torch()
    model = zoo_steps.MODELS[name]
    exported = hf.config_to_hf(zoo_steps.ls_jax_config(name))
    gpt = {"use_cache": False, "bos_token_id": model.vocab - 1, "eos_token_id": model.vocab - 1}
    return transformers.AutoConfig.for_model(
        **exported, **(gpt if model.kind == "gpt" else {}), attn_implementation="sdpa"
    )


def hf_model(name: str):
    """A randomly initialized transformers model of ``name`` (f32 parameters, train mode, on the CPU)."""
    _, transformers = import_torch()
    config = hf_config(name)
    if zoo_steps.MODELS[name].kind == "bert":
        return transformers.BertForSequenceClassification(config).train()
    return transformers.GPT2LMHeadModel(config).train()


def torch_batch(batch: dict[str, Any], device) -> dict[str, Any]:
    """A `zoo_steps.make_batch` batch as int64 tensors on ``device``, copied once: ``input_ids``, ``labels`` and,
    for BERT, ``attention_mask`` (1 on each row's real tokens, which come first)."""
    torch, _ = import_torch()
    return {key: torch.from_numpy(np.asarray(value, dtype=np.int64)).to(device) for key, value in batch.items()}


def loss_of(model, batch: dict[str, Any]):
    """Mean cross entropy of ``model``'s logits in f32 against ``batch["labels"]``: BERT's class per row, GPT-2's
    next token at every position (the labels are the inputs shifted by one already, as the JAX steps read them)."""
    torch, _ = import_torch()
    if "attention_mask" in batch:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    else:
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


@dataclasses.dataclass
class TorchStep:
    """A PyTorch train step over ``model`` and ``optimizer`` on one batch held on ``device``: ``run()`` advances
    them one step and gives the loss, a tensor the device may still be computing."""

    run: Callable[[], Any]
    model: Any
    optimizer: Any
    device: Any

    def wait(self, _: Any = None) -> None:
        """Returns once the device has finished every step run so far."""
        torch, _ = import_torch()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def memory_bytes(self) -> int | None:
        """The most device memory PyTorch's allocator held in tensors since `build_step` (None on a CPU)."""
        torch, _ = import_torch()
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    def device_name(self) -> str:
        torch, _ = import_torch()
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"


def build_step(name: str, batch: dict[str, Any], compiled: bool = True, seed: int = 0) -> TorchStep:
    """The train step of zoo model ``name`` on ``batch`` (a `zoo_steps.make_batch` batch), under ``torch.compile``
    unless ``compiled`` is False (eager, for tests). Compilation happens on the first ``run()``; the device's peak
    memory statistic restarts here."""
    torch, _ = import_torch()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Dynamo keys compiled code by code object, which the steps of every model share: each step compiles afresh,
    # and the step built before, no longer held by Dynamo, leaves the device before its peak memory restarts.
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = hf_model(name).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda"
    )
    inputs = torch_batch(batch, device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return TorchStep(torch.compile(step) if compiled else step, model, optimizer, device)


def versions() -> dict[str, str]:
    """The versions of torch and transformers a record was measured with."""
    torch, transformers = import_torch()
    return {"torch": torch.__version__, "transformers": transformers.__version__}
