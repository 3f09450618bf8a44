"""BERT's family on fastbert's encoder: RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT and MPNet.

Each architecture is fastbert.modeling's encoder with its own config (fastbert.family_config), module names,
forward arguments and masked-LM head, under transformers' parameter names, so their checkpoints load and save
unchanged. The layer, attention, FFN and LayerNorm code is modeling's; here are only the names and what an
architecture adds: DistilBERT's layer names, MPNet's relative-position bias (read by the attention kernel
from its [buckets, heads] table), ELECTRA's embedding projection (a config switch in BertModel). Their other
heads (classification, tokens, spans, choices) run through `fastbert.apply` on transformers' own classes.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import ops, outputs
from fastbert.family_config import (MPNET_BUCKETS, MPNET_MAX_DISTANCE, CamembertConfig, DistilBertConfig,
                                    ElectraConfig, MPNetConfig, RobertaConfig, XLMRobertaConfig)
from fastbert.modeling import (AttentionLayout, BertEncoder, BertForMaskedLM, BertLayer, BertModel,
                               BertPreTrainedModel, EncoderLayer, SelfAttention, VocabularyHead, _recompute,
                               add_and_norm, fused_feed_forward, fused_feed_forward_sublayer, gelu_dense_norm,
                               check_layout, is_unhooked, linear, one_node_sublayers, run_dropout, Submodule,
                               token_padding_mask)


# RoBERTa, XLM-RoBERTa, CamemBERT: BERT's modules and names; positions from the padding index (config) -----

class RobertaModel(BertModel):
    config_class = RobertaConfig
    base_model_prefix = "roberta"


class RobertaLMHead(nn.Module):
    """dense -> GELU -> layer_norm -> decoder (its bias tied to the head's `bias`), transformers' names."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))  # the decoder's bias when tied (tie_weights)

    def vocabulary_head(self) -> VocabularyHead:
        # transformers' RobertaLMHead and MPNetLMHead call the exact (erf) GELU whatever hidden_act says
        def transform(h):
            return gelu_dense_norm(self.config, self.dense, self.layer_norm, h, approximate="none")
        # the decoder's own bias, as transformers' forward calls the decoder: with tie_word_embeddings=False
        # it is not tied to the head's `bias`, which is then unused
        return VocabularyHead(self.config, transform, self.decoder, self.decoder.bias, bias_in_decoder=True)

    def forward(self, features):
        return self.vocabulary_head().logits(features)


class RobertaForMaskedLM(BertForMaskedLM):
    """Masked LM with RoBERTa's lm_head; loss, mask_token_id and return_logits as BertForMaskedLM."""

    config_class = RobertaConfig
    base_model_class = RobertaModel
    base_model_prefix = "roberta"
    _tied_weights_keys = {"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
                          "lm_head.decoder.bias": "lm_head.bias"}
    decoder_path, bias_path = "lm_head.decoder", "lm_head.bias"
    output_embeddings_bring_bias = False  # transformers' RoBERTa sets the decoder alone

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        setattr(self, self.base_model_prefix, self.base_model_class(config, add_pooling_layer=False))
        self.lm_head = RobertaLMHead(config)
        self.post_init()

    def vocabulary_head(self) -> VocabularyHead:
        return self.lm_head.vocabulary_head()


class XLMRobertaModel(RobertaModel):
    config_class = XLMRobertaConfig


class XLMRobertaForMaskedLM(RobertaForMaskedLM):
    config_class = XLMRobertaConfig
    base_model_class = XLMRobertaModel


class CamembertModel(RobertaModel):
    config_class = CamembertConfig


class CamembertForMaskedLM(RobertaForMaskedLM):
    config_class = CamembertConfig
    base_model_class = CamembertModel


# ELECTRA: BERT's modules; embeddings of embedding_size projected by BertModel.embeddings_project; no pooler --

class ElectraModel(BertModel):
    """Embeddings (projected where embedding_size differs from hidden_size) and L encoder layers, with no pooler:
    transformers' ElectraModel. Layouts as BertModel's."""
    config_class = ElectraConfig
    base_model_prefix = "electra"
    has_pooler = False

    def __init__(self, config: ElectraConfig):  # transformers' signature: no add_pooling_layer, there is no pooler
        super().__init__(config)


class ElectraGeneratorPredictions(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.LayerNorm = nn.LayerNorm(config.embedding_width, eps=config.layer_norm_eps)
        self.dense = nn.Linear(config.hidden_size, config.embedding_width)


class ElectraForMaskedLM(BertForMaskedLM):
    """ELECTRA's generator: generator_predictions (dense to embedding_size, GELU, LayerNorm) and
    generator_lm_head tied to the word embeddings."""

    config_class = ElectraConfig
    base_model_prefix = "electra"
    _tied_weights_keys = {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"}
    decoder_path, bias_path = "generator_lm_head", "generator_lm_head.bias"

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.electra = ElectraModel(config)
        self.generator_predictions = ElectraGeneratorPredictions(config)
        self.generator_lm_head = nn.Linear(config.embedding_width, config.vocab_size)
        self.post_init()

    def vocabulary_head(self) -> VocabularyHead:
        predictions = self.generator_predictions
        # transformers' ElectraGeneratorPredictions calls the exact (erf) GELU whatever hidden_act says
        return VocabularyHead(self.config,
                              lambda h: gelu_dense_norm(self.config, predictions.dense, predictions.LayerNorm, h,
                                                        approximate="none"),
                              self.generator_lm_head, self.generator_lm_head.bias, bias_in_decoder=True)


class ElectraDiscriminatorPredictions(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, discriminator_hidden_states):
        hidden = F.gelu(self.dense(discriminator_hidden_states), approximate=self.config.gelu_approximate)
        return self.dense_prediction(hidden).squeeze(-1)  # [B, S]


class ElectraForPreTraining(BertPreTrainedModel):
    """ELECTRA's discriminator: one logit per token, "was this token replaced"; labels [B, S] of 0 / 1, the
    loss a binary cross entropy over the real tokens (attention_mask), as transformers'."""

    config_class = ElectraConfig
    base_model_prefix = "electra"

    def __init__(self, config):
        super().__init__(config)
        self.electra = ElectraModel(config)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, validate=True, **kwargs):
        base = self.electra(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                            return_dict=True, validate=validate, **kwargs)
        logits = self.discriminator_predictions(base.last_hidden_state)  # [B, S]
        loss = None
        if labels is not None:
            if tuple(labels.shape) != tuple(logits.shape):
                raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(logits.shape)}")
            if attention_mask is not None:  # the tokens' columns (not a prefix's: fastbert.prefix)
                real = token_padding_mask(attention_mask, logits.shape[1]).reshape(-1) == 1
                loss = F.binary_cross_entropy_with_logits(logits.reshape(-1)[real], labels.reshape(-1)[real].float())
            else:
                loss = F.binary_cross_entropy_with_logits(logits.reshape(-1), labels.reshape(-1).float())
        result = outputs.ElectraForPreTrainingOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                     attentions=base.attentions)
        return self._outputs(result, return_dict)


def no_token_types(kwargs: dict) -> dict:
    """kwargs without token_type_ids, which transformers' DistilBERT and MPNet take and ignore (they have no
    token types; tokenizers and clients may pass them)."""
    kwargs.pop("token_type_ids", None)
    return kwargs


# DistilBERT: its own names (q_lin, sa_layer_norm, ffn.lin1, ...); no token types, no pooler -----------------

class DistilBertSelfAttention(SelfAttention):
    q_lin, k_lin, v_lin, out_lin, dropout = Submodule(), Submodule(), Submodule(), Submodule(), Submodule()

    def __init__(self, config):
        super().__init__(config)
        self.q_lin = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_lin = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_lin = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_lin = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def linears(self):
        return self.q_lin, self.k_lin, self.v_lin


class FFN(nn.Module):
    """lin2(gelu(lin1(x))) then dropout: DistilBERT's feed-forward, called where it cannot be fused."""
    lin1, lin2, dropout = Submodule(), Submodule(), Submodule()

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lin1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.lin2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden):
        hidden = self.lin2(F.gelu(self.lin1(hidden), approximate=self.config.gelu_approximate))
        return run_dropout(self.dropout, hidden, self.config)


class TransformerBlock(EncoderLayer):
    """DistilBERT's layer: sa_layer_norm(out_lin(attention) + x) (no dropout on that sum, as transformers'),
    then output_layer_norm(dropout(ffn) + that)."""
    attention, sa_layer_norm, ffn, output_layer_norm = Submodule(), Submodule(), Submodule(), Submodule()

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attention = DistilBertSelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = FFN(config)
        self.output_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def attention_block(self, hidden, layout: AttentionLayout, output_attentions: bool):
        attention = self.attention
        if (not output_attentions and torch.is_grad_enabled() and one_node_sublayers(self.config, hidden)
                and is_unhooked(attention, DistilBertSelfAttention)):
            normed = attention.sublayer(hidden, layout, attention.out_lin, self.sa_layer_norm, None)
            if normed is not None:
                return normed, None
        context, probs = attention(hidden, layout, output_attentions)
        return add_and_norm(self.config, self.sa_layer_norm, linear(attention.out_lin, context), hidden, None), probs

    def feed_forward(self, attended, recompute: bool = False):
        c = self.config
        if is_unhooked(self.ffn, FFN):
            if torch.is_grad_enabled() and one_node_sublayers(c, attended):
                normed = fused_feed_forward_sublayer(c, self.ffn.lin1, self.ffn.lin2, self.output_layer_norm,
                                                     self.ffn.dropout, attended, recompute)
                if normed is not None:
                    return normed
            projected = fused_feed_forward(c, self.ffn.lin1, self.ffn.lin2, attended, recompute)
            if projected is not None:
                return add_and_norm(c, self.output_layer_norm, projected, attended, self.ffn.dropout)

        def block(a):
            return add_and_norm(c, self.output_layer_norm, self.ffn(a), a, None)
        return _recompute(block, attended) if recompute else block(attended)


class Transformer(BertEncoder):
    layer_class = TransformerBlock


def sinusoidal_positions(positions: int, width: int) -> torch.Tensor:
    """[positions, width]: sin on even columns, cos on odd ones, at 10000^(2i / width) (DistilBERT's
    sinusoidal_pos_embds)."""
    position = torch.arange(positions, dtype=torch.float64)[:, None]
    frequency = torch.pow(10000.0, -torch.arange(0, width, 2, dtype=torch.float64) / width)
    table = torch.zeros(positions, width, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table.float()


class DistilBertPreTrainedModel(BertPreTrainedModel):
    config_class = DistilBertConfig
    base_model_prefix = "distilbert"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if self.config.sinusoidal_pos_embds and module is self._bert().embeddings.position_embeddings:
            module.weight.copy_(sinusoidal_positions(*module.weight.shape))


class DistilBertModel(DistilBertPreTrainedModel, BertModel):
    """Embeddings (no token types) and L transformer blocks, with no pooler: transformers' DistilBertModel.
    Layouts as BertModel's."""
    encoder_class = Transformer
    encoder_name = "transformer"
    has_pooler = False
    has_cross_attentions = False
    takes_cache = False

    def __init__(self, config: DistilBertConfig):  # transformers' signature: no add_pooling_layer, there is no pooler
        super().__init__(config)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, position_ids=None, **kwargs):
        """transformers' DistilBertModel arguments (no token types); the rest as BertModel.forward."""
        return BertModel.forward(self, input_ids, attention_mask, None, position_ids, inputs_embeds,
                                 **no_token_types(kwargs))


class DistilBertForMaskedLM(DistilBertPreTrainedModel, BertForMaskedLM):
    """vocab_transform -> GELU -> vocab_layer_norm -> vocab_projector (tied to the word embeddings)."""

    _tied_weights_keys = {"vocab_projector.weight": "distilbert.embeddings.word_embeddings.weight"}
    decoder_path, bias_path = "vocab_projector", "vocab_projector.bias"

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.distilbert = DistilBertModel(config)
        self.vocab_transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.vocab_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.vocab_projector = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def vocabulary_head(self) -> VocabularyHead:
        return VocabularyHead(self.config,
                              lambda h: gelu_dense_norm(self.config, self.vocab_transform, self.vocab_layer_norm, h),
                              self.vocab_projector, self.vocab_projector.bias, bias_in_decoder=True)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        return BertForMaskedLM.forward(self, input_ids, attention_mask, None, kwargs.pop("position_ids", None),
                                       inputs_embeds, labels, **no_token_types(kwargs))


# MPNet: BERT's FFN names, its own attention names, and the relative-position bias ---------------------------

class MPNetSelfAttention(SelfAttention):
    q, k, v, o, dropout = Submodule(), Submodule(), Submodule(), Submodule(), Submodule()

    def __init__(self, config):
        super().__init__(config)
        self.q = nn.Linear(config.hidden_size, config.hidden_size)
        self.k = nn.Linear(config.hidden_size, config.hidden_size)
        self.v = nn.Linear(config.hidden_size, config.hidden_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def linears(self):
        return self.q, self.k, self.v

    def probs_dropout(self) -> float:
        """transformers' MPNet calls its Dropout on the probabilities: the Dropout's own training mode counts."""
        return self.dropout.p if self.dropout.training else 0.0


class MPNetAttention(nn.Module):
    """LayerNorm(dropout(o(attention)) + x)."""
    attn, LayerNorm, dropout = Submodule(), Submodule(), Submodule()

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        attention = self.attn
        if (not output_attentions and torch.is_grad_enabled() and one_node_sublayers(self.config, hidden)
                and is_unhooked(attention, MPNetSelfAttention)):
            normed = attention.sublayer(hidden, layout, attention.o, self.LayerNorm, self.dropout)
            if normed is not None:
                return normed, None
        context, probs = attention(hidden, layout, output_attentions)
        return add_and_norm(self.config, self.LayerNorm, linear(attention.o, context), hidden, self.dropout), probs


class MPNetLayer(BertLayer):
    def __init__(self, config):
        super().__init__(config)
        self.attention = MPNetAttention(config)


class MPNetEncoder(BertEncoder):
    """The layers and the relative-position bias table [buckets, heads] they share: every attention adds
    table[bucket(key - query), head] to its scores, the kernel computing each tile's buckets (no [heads, S, S]
    tensor), so the table gets its gradient."""

    layer_class = MPNetLayer

    def __init__(self, config):
        super().__init__(config)
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)

    def forward(self, hidden, layout: AttentionLayout, output_hidden_states=False, output_attentions=False):
        check_layout(self, layout)  # before the layout is copied
        weight = self.relative_attention_bias.weight
        buckets = ops.relative_position_buckets(MPNET_BUCKETS, MPNET_MAX_DISTANCE, device=weight.device)
        layout = dataclasses.replace(layout, relative_bias=weight, relative_buckets=buckets)
        return super().forward(hidden, layout, output_hidden_states, output_attentions)


class MPNetPreTrainedModel(BertPreTrainedModel):
    config_class = MPNetConfig
    base_model_prefix = "mpnet"


class MPNetModel(MPNetPreTrainedModel, BertModel):
    encoder_class = MPNetEncoder
    has_cross_attentions = False
    takes_cache = False

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        """transformers' MPNetModel arguments (no token types); the rest as BertModel.forward."""
        return BertModel.forward(self, input_ids, attention_mask, None, position_ids, inputs_embeds,
                                 **no_token_types(kwargs))


class MPNetForMaskedLM(MPNetPreTrainedModel, RobertaForMaskedLM):
    base_model_class = MPNetModel
    _tied_weights_keys = {"lm_head.decoder.weight": "mpnet.embeddings.word_embeddings.weight",
                          "lm_head.decoder.bias": "lm_head.bias"}
    output_embeddings_bring_bias = True  # transformers' MPNet, unlike RoBERTa, sets the head's bias too

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        return BertForMaskedLM.forward(self, input_ids, attention_mask, None, position_ids, inputs_embeds, labels,
                                       **no_token_types(kwargs))


# the model classes of each architecture, by transformers' class name
FAMILY_CLASSES = {cls.__name__: cls for cls in (
    RobertaModel, RobertaForMaskedLM, XLMRobertaModel, XLMRobertaForMaskedLM, CamembertModel,
    CamembertForMaskedLM, ElectraModel, ElectraForMaskedLM, ElectraForPreTraining, DistilBertModel,
    DistilBertForMaskedLM, MPNetModel, MPNetForMaskedLM)}
