"""BERT (Devlin et al., 2018) as nn.Modules with HF transformers' parameter names, forward arguments
and outputs. Every fused computation goes through `fastbert.ops`, which picks the Triton kernel or
the PyTorch reference (config.backend); nothing here launches a kernel or branches on a device.

Shapes: B batch, S sequence length, H hidden size, T packed tokens (config.unpad), V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastbert import ops, outputs
from fastbert.config import BertConfig
from fastbert.validation import IGNORE_INDEX, check_labels, check_model_inputs


@dataclass
class AttentionLayout:
    """How the encoder's tokens are laid out: padded [B, S, H] with a key mask, or packed [T, H]."""
    attention_mask: torch.Tensor | None = None  # [B, S], padded layout
    cu_seqlens: torch.Tensor | None = None  # int32 [B+1], packed layout
    max_seqlen: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        embeds = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        seqlen = embeds.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seqlen, device=embeds.device)[None, :]
        embeds = embeds + self.position_embeddings(position_ids)
        if token_type_ids is None:
            embeds = embeds + self.token_type_embeddings.weight[0]
        else:
            embeds = embeds + self.token_type_embeddings(token_type_ids)
        hidden = ops.layer_norm(embeds, self.LayerNorm.weight, self.LayerNorm.bias, self.config.layer_norm_eps,
                                backend=self.config.backend)
        return F.dropout(hidden, self.config.hidden_dropout_prob, self.training)


def _split_qkv(module, state_dict, prefix, local_metadata):
    """state_dict hook: the fused qkv Linear is written as HF's separate query, key and value."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}")
        for name, part in zip(("query", "key", "value"), fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


def _join_qkv(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: HF's query, key and value are concatenated into the fused qkv Linear."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}{name}.{kind}" for name in ("query", "key", "value")]
        if all(n in state_dict for n in names):
            state_dict[f"{prefix}qkv.{kind}"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention; query, key and value are one [3H, H] Linear, saved as HF's three."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_join_qkv)

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        config = self.config
        heads = config.num_attention_heads
        dropout_p = config.attention_probs_dropout_prob if self.training else 0.0
        q, k, v = ops.qkv_projection(hidden, self.qkv.weight, self.qkv.bias, heads, backend=config.backend)
        if output_attentions:  # the probabilities are wanted: [B, heads, S, S] is materialised
            context, probs = ops.attention_with_probs(q, k, v, layout.attention_mask, dropout_p)
        elif layout.packed:
            probs = None
            context = ops.attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout_p,
                                           backend=config.backend)  # [T, heads, d]
        else:
            probs = None
            context = ops.attention(q, k, v, layout.attention_mask, dropout_p, backend=config.backend)
        if layout.packed:
            context = context.reshape(hidden.shape)  # [T, H]
        else:
            context = context.transpose(1, 2).reshape(hidden.shape)  # [B, heads, S, d] -> [B, S, H]
        return context, probs


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden, residual):
        c = self.config
        return ops.layer_norm(self.dense(hidden), self.LayerNorm.weight, self.LayerNorm.bias, c.layer_norm_eps,
                              residual=residual, dropout_p=c.hidden_dropout_prob, training=self.training,
                              backend=c.backend)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        context, probs = self.self(hidden, layout, output_attentions)
        return self.output(context, hidden), probs


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden):
        return ops.linear_bias_gelu(hidden, self.dense.weight, self.dense.bias, self.config.gelu_approximate,
                                    backend=self.config.backend)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        attended, probs = self.attention(hidden, layout, output_attentions)
        return self.output(self.intermediate(attended), attended), probs


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.gradient_checkpointing = False

    def forward(self, hidden, layout: AttentionLayout, output_hidden_states=False, output_attentions=False):
        all_hidden = [hidden] if output_hidden_states else None
        all_probs = [] if output_attentions else None
        for layer in self.layer:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Layer inputs are kept, activations recomputed in the backward. Dropout masks come from
                # seeds drawn from torch's RNG, which checkpoint restores, so the recomputation matches.
                hidden, probs = checkpoint(layer, hidden, layout, output_attentions, use_reentrant=False)
            else:
                hidden, probs = layer(hidden, layout, output_attentions)
            if output_hidden_states:
                all_hidden.append(hidden)
            if output_attentions:
                all_probs.append(probs)
        return hidden, all_hidden, all_probs


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output):
        return torch.tanh(self.dense(sequence_output[:, 0]))  # [B, H] from the [CLS] token


class BertPreTrainedModel(nn.Module):
    """Weight init as transformers, and HF checkpoint load / save (fastbert.hf does the file work)."""

    base_model_prefix = "bert"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

    def post_init(self) -> None:
        """Initialise the weights of every submodule not initialised yet (a head's post_init skips the
        BertModel inside it, which initialised itself), then tie the MLM decoder."""
        for module in self.modules():
            if not getattr(module, "_fastbert_initialized", False):
                self._init_weights(module)
                module._fastbert_initialized = True
        self.tie_weights()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """The MLM decoder shares the word embedding matrix (heads that have one override nothing else)."""
        head = getattr(getattr(self, "cls", None), "predictions", None)
        if head is not None:
            head.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each encoder layer in the backward instead of keeping its activations."""
        self._base_model().encoder.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self._base_model().encoder.gradient_checkpointing = False

    def _base_model(self) -> "BertModel":
        return self if isinstance(self, BertModel) else self.bert

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @classmethod
    def from_pretrained(cls, path, output_loading_info: bool = False, **config_overrides):
        """Load an HF BERT directory (config.json + model.safetensors or pytorch_model.bin).

        config_overrides replace config.json's fields (e.g. backend="triton", num_labels=3).
        Missing and unexpected keys are reported in a warning and, with output_loading_info=True,
        returned as (model, {"missing_keys": [...], "unexpected_keys": [...]}).
        """
        from fastbert import hf
        return hf.load_pretrained(cls, path, output_loading_info, **config_overrides)

    def save_pretrained(self, path) -> None:
        """Write config.json + model.safetensors that transformers' from_pretrained loads unchanged."""
        from fastbert import hf
        hf.save_pretrained(self, path)

    def to_hf(self):
        """The same model as a transformers object with identical weights (needs transformers)."""
        from fastbert import hf
        return hf.to_hf(self)


class BertModel(BertPreTrainedModel):
    """Embeddings, L encoder layers and the [CLS] pooler. With config.unpad the padding is removed
    once after the embeddings, every layer runs on the T real tokens, and the output is padded back."""

    base_model_prefix = ""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_hidden_states=False, output_attentions=False, return_dict=True,
                validate=True):
        batch, seqlen = check_model_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids,
                                           inputs_embeds, validate)
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # [B, S, H]
        unpadded = self.config.unpad and attention_mask is not None and not output_attentions
        if unpadded:
            hidden, indices, cu_seqlens, max_seqlen = ops.unpad(hidden, attention_mask)  # [T, H]
            layout = AttentionLayout(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        else:
            layout = AttentionLayout(attention_mask=attention_mask)
        hidden, all_hidden, all_probs = self.encoder(hidden, layout, output_hidden_states, output_attentions)
        if unpadded:
            hidden = ops.pad(hidden, indices, batch, seqlen)
            if all_hidden is not None:
                all_hidden = [ops.pad(h, indices, batch, seqlen) for h in all_hidden]
        result = outputs.BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden,
            pooler_output=self.pooler(hidden) if self.pooler is not None else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_probs) if all_probs is not None else None)
        return result if return_dict else result.to_tuple()


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden):
        c = self.config
        hidden = ops.linear_bias_gelu(hidden, self.dense.weight, self.dense.bias, c.gelu_approximate,
                                      backend=c.backend)
        return ops.layer_norm(hidden, self.LayerNorm.weight, self.LayerNorm.bias, c.layer_norm_eps,
                              backend=c.backend)


class BertLMPredictionHead(nn.Module):
    """transform -> decoder tied to the word embeddings, with its own bias."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, sequence_output):
        """Logits for every position: [B, S, H] -> [B, S, V]."""
        return F.linear(self.transform(sequence_output), self.decoder.weight, self.bias)

    def masked_loss(self, sequence_output, labels, shown_masked=None):
        """Cross entropy on the labelled positions only (labels != -100): the transform runs on those rows,
        and the decoder + softmax never hold [rows, V] logits. Returns (loss, accuracy, masked_accuracy).

        shown_masked: bool [B, S] or None, the positions whose input is [MASK]. With it the labelled rows
        go through the loss in two parts, [MASK] and the others (the same loss), and masked_accuracy is
        the accuracy of the first part alone, which copying the input cannot raise; without it, None.
        """
        flat_labels = labels.reshape(-1)
        labelled = flat_labels != IGNORE_INDEX
        if shown_masked is None:
            loss, correct, count = self._loss_sum(sequence_output, flat_labels, labelled, "mean")
            return loss, correct / max(count, 1), None
        masked = labelled & shown_masked.reshape(-1)
        masked_loss, masked_correct, masked_count = self._loss_sum(sequence_output, flat_labels, masked, "sum")
        other_loss, other_correct, other_count = self._loss_sum(sequence_output, flat_labels, labelled & ~masked, "sum")
        count = max(masked_count + other_count, 1)
        return ((masked_loss + other_loss) / count, (masked_correct + other_correct) / count,
                masked_correct / max(masked_count, 1))

    def _loss_sum(self, sequence_output, flat_labels, which, reduction):
        """(loss, correct, rows) of linear_cross_entropy over the rows where `which` (bool [B*S]) holds."""
        rows = which.nonzero().squeeze(1)  # [N]
        selected = sequence_output.reshape(-1, sequence_output.shape[-1]).index_select(0, rows)  # [N, H]
        loss, correct = ops.linear_cross_entropy(self.transform(selected), self.decoder.weight, self.bias,
                                                 flat_labels.index_select(0, rows), reduction=reduction,
                                                 backend=self.config.backend)
        return loss, correct, rows.numel()


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


def _wants_logits(module: nn.Module, labels, return_logits: bool | None) -> bool:
    """Full [B, S, V] logits when asked, or by default when there are no labels or in eval mode."""
    return return_logits if return_logits is not None else (labels is None or not module.training)


def _nsp_loss(logits, labels):
    """(loss, accuracy) of the 2-way next-sentence classifier. logits [B, 2], labels [B]."""
    return F.cross_entropy(logits, labels), (logits.argmax(dim=-1) == labels).float().mean()


class BertForPreTraining(BertPreTrainedModel):
    """BERT's pretraining model: masked LM + next sentence prediction; loss = MLM + NSP.

    With labels the MLM loss runs on the labelled positions only (fastbert.ops.linear_cross_entropy).
    return_logits: None (default) returns prediction_logits when there are no labels or in eval mode;
    False never materialises them (the training path); True always does. mask_token_id (with labels):
    also report mlm_mask_accuracy, the accuracy at the positions whose input is that token.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, output_hidden_states=False,
                output_attentions=False, return_dict=True, return_logits=None, validate=True, mask_token_id=None):
        if mask_token_id is not None and input_ids is None:
            raise ValueError("mask_token_id needs input_ids (the [MASK] positions are read from them)")
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        sequence_output = base.last_hidden_state
        check_labels("labels", labels, sequence_output.shape[:2], self.config.vocab_size, "vocab_size", validate)
        check_labels("next_sentence_label", next_sentence_label, sequence_output.shape[:1], 2, "2 classes",
                     validate)
        head = self.cls.predictions
        mlm_loss = mlm_accuracy = mlm_mask_accuracy = nsp_loss = nsp_accuracy = None
        if labels is not None:
            shown_masked = None if mask_token_id is None else input_ids == mask_token_id
            mlm_loss, mlm_accuracy, mlm_mask_accuracy = head.masked_loss(sequence_output, labels, shown_masked)
        nsp_logits = self.cls.seq_relationship(base.pooler_output)  # [B, 2]
        if next_sentence_label is not None:
            nsp_loss, nsp_accuracy = _nsp_loss(nsp_logits, next_sentence_label)
        terms = [t for t in (mlm_loss, nsp_loss) if t is not None]
        result = outputs.BertForPreTrainingOutput(
            loss=sum(terms) if terms else None,
            prediction_logits=head(sequence_output) if _wants_logits(self, labels, return_logits) else None,
            seq_relationship_logits=nsp_logits, hidden_states=base.hidden_states, attentions=base.attentions,
            mlm_loss=mlm_loss, nsp_loss=nsp_loss, mlm_accuracy=mlm_accuracy,
            mlm_mask_accuracy=mlm_mask_accuracy, nsp_accuracy=nsp_accuracy)
        return result if return_dict else result.to_tuple()


class BertForMaskedLM(BertPreTrainedModel):
    """Masked LM head only (no pooler). return_logits as in BertForPreTraining."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states=False, output_attentions=False,
                return_dict=True, return_logits=None, validate=True):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        sequence_output = base.last_hidden_state
        check_labels("labels", labels, sequence_output.shape[:2], self.config.vocab_size, "vocab_size", validate)
        head = self.cls.predictions
        loss = accuracy = None
        if labels is not None:
            loss, accuracy, _ = head.masked_loss(sequence_output, labels)
        result = outputs.MaskedLMOutput(
            loss=loss, logits=head(sequence_output) if _wants_logits(self, labels, return_logits) else None,
            hidden_states=base.hidden_states, attentions=base.attentions, accuracy=accuracy)
        return result if return_dict else result.to_tuple()


class BertForNextSentencePrediction(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states=False, output_attentions=False,
                return_dict=True, validate=True):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        logits = self.cls.seq_relationship(base.pooler_output)  # [B, 2]
        check_labels("labels", labels, logits.shape[:1], 2, "2 classes", validate)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        result = outputs.NextSentencePredictorOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                     attentions=base.attentions)
        return result if return_dict else result.to_tuple()


def _classifier_dropout(config: BertConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class BertForSequenceClassification(BertPreTrainedModel):
    """Pooled [CLS] -> dropout -> Linear(num_labels). Loss as transformers chooses it by
    config.problem_type: regression (MSE) when num_labels == 1, single-label cross entropy for integer
    labels, multi-label BCE-with-logits for float labels."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states=False, output_attentions=False,
                return_dict=True, validate=True):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        logits = self.classifier(self.dropout(base.pooler_output))  # [B, num_labels]
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif not labels.is_floating_point():
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).reshape(logits.shape[:1]))
            elif self.config.problem_type == "single_label_classification":
                check_labels("labels", labels.reshape(-1), logits.shape[:1], self.num_labels, "num_labels",
                             validate)
                loss = F.cross_entropy(logits, labels.reshape(-1))
            else:
                if tuple(labels.shape) != tuple(logits.shape):
                    raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(logits.shape)} "
                                     "for multi-label classification")
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        result = outputs.SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                  attentions=base.attentions)
        return result if return_dict else result.to_tuple()


class BertForTokenClassification(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states=False, output_attentions=False,
                return_dict=True, validate=True):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        logits = self.classifier(self.dropout(base.last_hidden_state))  # [B, S, num_labels]
        check_labels("labels", labels, logits.shape[:2], self.num_labels, "num_labels", validate)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, self.num_labels), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        result = outputs.TokenClassifierOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                               attentions=base.attentions)
        return result if return_dict else result.to_tuple()


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span extraction: start and end logits per token. Positions outside the sequence are clamped
    to S and ignored, as in transformers."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        if config.num_labels != 2:
            raise ValueError(f"BertForQuestionAnswering needs config.num_labels == 2 (start and end logits), "
                             f"got {config.num_labels}")
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_hidden_states=False,
                output_attentions=False, return_dict=True, validate=True):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states, output_attentions, validate=validate)
        logits = self.qa_outputs(base.last_hidden_state)  # [B, S, 2]
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            seqlen = start_logits.shape[1]
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                if positions.is_floating_point() or positions.reshape(-1).shape != start_logits.shape[:1]:
                    raise ValueError(f"{name} must be integer positions of shape {tuple(start_logits.shape[:1])}, "
                                     f"got {positions.dtype} {tuple(positions.shape)}")
            start = start_positions.reshape(-1).clamp(0, seqlen)
            end = end_positions.reshape(-1).clamp(0, seqlen)
            loss = (F.cross_entropy(start_logits, start, ignore_index=seqlen)
                    + F.cross_entropy(end_logits, end, ignore_index=seqlen)) / 2
        result = outputs.QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                                      hidden_states=base.hidden_states, attentions=base.attentions)
        return result if return_dict else result.to_tuple()


class BertForMultipleChoice(BertPreTrainedModel):
    """Inputs [B, choices, S]; each choice scored from its pooled [CLS]; logits [B, choices]."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states=False, output_attentions=False,
                return_dict=True, validate=True):
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("input_ids must be [batch, num_choices, seq_len] (or inputs_embeds "
                             f"[batch, num_choices, seq_len, hidden]), got "
                             f"{None if source is None else tuple(source.shape)}")
        num_choices = source.shape[1]

        def flat(t):  # [B, C, S, ...] -> [B*C, S, ...]
            return None if t is None else t.reshape(-1, *t.shape[2:])

        base = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                         flat(inputs_embeds), output_hidden_states, output_attentions, validate=validate)
        logits = self.classifier(self.dropout(base.pooler_output)).view(-1, num_choices)  # [B, C]
        check_labels("labels", labels, logits.shape[:1], num_choices, "num_choices", validate)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        result = outputs.MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                   attentions=base.attentions)
        return result if return_dict else result.to_tuple()


MODEL_CLASSES = {cls.__name__: cls for cls in (
    BertModel, BertForPreTraining, BertForMaskedLM, BertForNextSentencePrediction,
    BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering, BertForMultipleChoice)}
