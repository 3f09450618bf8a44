"""Model outputs with transformers' class and attribute names.

Each is a transformers `ModelOutput` where transformers imports (and fastbert.bases' stand-in otherwise):
attribute access, `out["name"]`, `"name" in out`, iteration over the keys that are not None, item
assignment, `out[i]` and `to_tuple()` over those fields, registered with torch's pytree (torch.export).
fastbert adds the MLM/NSP losses and accuracies to the MLM and pretraining outputs; transformers'
Trainer leaves them out of its predictions (BertConfig.keys_to_ignore_at_inference), and a model's tuple
(return_dict=False) leaves them out too: it holds transformers' fields in transformers' order (transformers_tuple).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastbert.bases import OutputBase

Tensor = torch.Tensor

# the fields fastbert's outputs add to transformers' (the MLM and pretraining heads' losses and accuracies)
FASTBERT_OUTPUTS = ("accuracy", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "mlm_mask_accuracy",
                   "mask_accuracy")


def transformers_tuple(output: OutputBase) -> tuple:
    """What transformers' model returns with return_dict=False: its output's fields that are not None, in order,
    without FASTBERT_OUTPUTS (`loss, logits = model(..., return_dict=False)` unpacks as it does with
    transformers', where the logits were computed: an MLM head in training skips them unless return_logits)."""
    return tuple(value for name, value in output.items() if name not in FASTBERT_OUTPUTS)


@dataclass
class BaseModelOutputWithPoolingAndCrossAttentions(OutputBase):
    last_hidden_state: Tensor | None = None  # [B, S, H]; padded positions are not meaningful
    pooler_output: Tensor | None = None  # [B, H]
    hidden_states: tuple[Tensor, ...] | None = None  # embeddings + each layer, each [B, S, H]
    attentions: tuple[Tensor, ...] | None = None  # each [B, heads, S, S]
    cross_attentions: tuple[Tensor, ...] | None = None  # () with output_attentions: an encoder attends to no other


@dataclass
class BertForPreTrainingOutput(OutputBase):
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
class MaskedLMOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, S, V]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    accuracy: Tensor | None = None  # fraction of labelled tokens predicted right
    mask_accuracy: Tensor | None = None  # the same at the positions whose input is the mask token (mask_token_id=)


@dataclass
class NextSentencePredictorOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, 2]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, num_labels]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class TokenClassifierOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, S, num_labels]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class QuestionAnsweringModelOutput(OutputBase):
    loss: Tensor | None = None
    start_logits: Tensor | None = None  # [B, S]
    end_logits: Tensor | None = None  # [B, S]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class MultipleChoiceModelOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, num_choices]
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class ElectraForPreTrainingOutput(OutputBase):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, S]: one "replaced" logit per token
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
