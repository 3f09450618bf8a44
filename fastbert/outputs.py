"""Model outputs with transformers' class and attribute names.

Like HF's ModelOutput: attribute access, `out["name"]`, `out[i]` over the fields that are not None,
and `to_tuple()`. fastbert adds the MLM/NSP losses and accuracies to the pretraining outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass
class ModelOutput:
    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: int | slice | str) -> Any:
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def __iter__(self):
        return iter(self.to_tuple())

    def __len__(self) -> int:
        return len(self.to_tuple())


@dataclass
class BaseModelOutputWithPoolingAndCrossAttentions(ModelOutput):
    last_hidden_state: Tensor | None = None  # [B, S, H]; padded positions are not meaningful
    pooler_output: Tensor | None = None  # [B, H]
    hidden_states: tuple[Tensor, ...] | None = None  # embeddings + each layer, each [B, S, H]
    attentions: tuple[Tensor, ...] | None = None  # each [B, heads, S, S]


@dataclass
class BertForPreTrainingOutput(ModelOutput):
    loss: Tensor | None = None  # mlm_loss + nsp_loss (the terms that have labels)
    prediction_logits: Tensor | None = None  # [B, S, V]
    seq_relationship_logits: Tensor | None = None  # [B, 2]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    mlm_loss: Tensor | None = None
    nsp_loss: Tensor | None = None
    mlm_accuracy: Tensor | None = None  # fraction of labelled tokens predicted right
    nsp_accuracy: Tensor | None = None
    mlm_mask_accuracy: Tensor | None = None  # the same at the positions shown as [MASK] (with mask_token_id)


@dataclass
class MaskedLMOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, S, V]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    accuracy: Tensor | None = None  # fraction of labelled tokens predicted right


@dataclass
class NextSentencePredictorOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, 2]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, num_labels]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class TokenClassifierOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, S, num_labels]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class QuestionAnsweringModelOutput(ModelOutput):
    loss: Tensor | None = None
    start_logits: Tensor | None = None  # [B, S]
    end_logits: Tensor | None = None  # [B, S]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class MultipleChoiceModelOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, num_choices]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
