"""The pretraining step a memory plan runs: fastbert's model on its Triton path and a batch of full-length
sequences, as `fastbert pretrain` trains them. `fastbert pretrain --micro-batch-size auto`
(simulated.device_fit.choose_micro_batch) and `fastbert bench --suite memory` (bench.memory_cases) plan the
same step from these, and bench.model_cases measures the same heads on a GPU.
"""
from __future__ import annotations

import math

import torch

LABEL_FRACTION = 0.15  # the share of the tokens labelled for the MLM loss (BERT's masking probability)


def training_head(config) -> str:
    """What a training step trains: BERT's pretraining heads (MLM + NSP), the masked LM alone for the rest."""
    return "ForPreTraining" if config.model_type == "bert" else "ForMaskedLM"


def label_budget(seqlen: int) -> int:
    """Labelled tokens per sequence: what `fastbert pretrain` sets as max_predictions_per_seq."""
    return math.ceil(seqlen * LABEL_FRACTION)


def fastbert_model(config, head: str, device: str | torch.device = "meta") -> torch.nn.Module:
    """fastbert's `head` model of config ("ForPreTraining", "ForMaskedLM", "Model", ...; see
    architectures.model_class) with config.backend as it is (inside planned_gpu, "auto" runs the paths the planned
    H100 runs: fastbert.paths), built on `device` (meta: sizes only)."""
    from fastbert.architectures import model_class  # imports transformers: only when a model is built

    with torch.device(device):
        return model_class(config, head)(config)


def pretraining_model(config, seqlen: int, head: str, device: str | torch.device = "meta") -> torch.nn.Module:
    """fastbert_model in training mode, its MLM loss reading label_budget(seqlen) labels per sequence (the static
    budget `fastbert pretrain` sets)."""
    return fastbert_model(config.replace(max_predictions_per_seq=label_budget(seqlen)), head, device).train()


def encoder_inputs(config, batch: int, seqlen: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Full-length sequences on the CPU: [B, S] int64 random ids (never 0), an all-ones [B, S] attention mask
    and, where the model has two segments (BERT), [B, S] token types 0 then 1 from the middle on."""
    tensors = {"input_ids": torch.randint(1, config.vocab_size, (batch, seqlen), generator=generator),
               "attention_mask": torch.ones(batch, seqlen, dtype=torch.long)}
    if config.type_vocab_size > 1:  # BERT's two segments; one-segment models (ModernBERT, mlm) take none
        tensors["token_type_ids"] = (torch.arange(seqlen) >= seqlen // 2).long().expand(batch, seqlen).contiguous()
    return tensors


def pretraining_batch(config, batch: int, seqlen: int, head: str,
                      device: str | torch.device = "meta") -> dict[str, torch.Tensor]:
    """A seeded pretraining batch on `device`: encoder_inputs, [B, S] int64 MLM labels (label_budget(S) random
    positions per sequence, -100 elsewhere) and, for the "ForPreTraining" head, [B] int64 NSP labels."""
    g = torch.Generator().manual_seed(0)
    tensors = encoder_inputs(config, batch, seqlen, g)
    positions = torch.rand(batch, seqlen, generator=g).argsort(dim=1)[:, :label_budget(seqlen)]  # [B, k]
    labels = torch.full((batch, seqlen), -100)
    labels.scatter_(1, positions, torch.randint(0, config.vocab_size, positions.shape, generator=g))
    next_sentence_label = torch.randint(0, 2, (batch,), generator=g)
    tensors["labels"] = labels
    if head == "ForPreTraining":
        tensors["next_sentence_label"] = next_sentence_label
    return {k: v.to(device) for k, v in tensors.items()}
