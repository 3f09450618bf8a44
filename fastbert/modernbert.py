"""ModernBERT (Warner et al., 2024) on fastbert's ops, with transformers' module tree and parameter names.

A pre-LayerNorm encoder: x = x + Wo(attention(attn_norm(x))); x = x + mlp(mlp_norm(x)); then final_norm.
The attention rotates q and k inside the flash kernel (rotary_base per layer type: 160,000 on global layers,
10,000 on local ones) and, on local layers, keeps the keys within a sliding window (|i - j| <= 64 for
local_attention = 128) and skips the blocks outside it. The attention's residual add and mlp_norm are one fused
LayerNorm that also returns the residual stream; the FFN is GeGLU with the gated product in the up-projection's
epilogue, and the down-projection's GEMM adds the stream; LayerNorms and Linears have no bias by default (norm_bias,
attention_bias, mlp_bias). On the kernels the encoder runs on packed rows (config.unpad is always True): a padded
batch is unpadded once after the embeddings; on the PyTorch path (what "auto" runs on CPU) it stays padded, as
transformers' SDPA ModernBERT (ModernBertModel.unpads says why). Rotary positions are each token's offset in its
sequence, so left padding and packing give what transformers' padded computation gives (rotary scores depend on
i - j only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import ops, outputs
from fastbert.config import GELU_APPROXIMATION
from fastbert.family_config import ModernBertConfig
from fastbert.modeling import (AttentionLayout, BertForMaskedLM, BertModel, BertPreTrainedModel, EncoderLayer,
                               HeadDropout, SelfAttention, VocabularyHead, _recompute, add_and_norm, dropout_rate,
                               gelu_dense_norm, is_plain_linear, is_unhooked, layer_norm, linear, one_node_sublayers,
                               run_dropout, run_layers, sequence_classification_loss, Submodule,
                               token_classification_loss, weight_and_bias)
from fastbert.validation import check_on_device, key_padding_mask


class ModernBertEmbeddings(nn.Module):
    """tok_embeddings -> norm -> dropout; no position table (positions are rotary) and no token types."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        embeds = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        return run_dropout(self.drop, layer_norm(self.config, self.norm, embeds), self.config)


class ModernBertAttention(SelfAttention):
    """Wqkv (one Linear [3H, H]) -> attention with rotary positions (and a window on local layers) -> the
    context; Wo and out_drop are applied by the layer, fused with the residual add and mlp_norm. Dropout
    switches as transformers': the float attention_dropout on the probabilities, the module out_drop after Wo
    (an nn.Identity where the config's attention_dropout is 0), both read at each forward."""
    Wqkv, Wo, out_drop = Submodule(), Submodule(), Submodule()

    def __init__(self, config: ModernBertConfig, layer: int):
        super().__init__(config)
        self.attention_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.out_drop = nn.Dropout(self.attention_dropout) if self.attention_dropout > 0.0 else nn.Identity()
        self.rotary_base = config.layer_rope_base(layer)
        self.window = config.layer_window(layer)

    def probs_dropout(self) -> float:
        return self.attention_dropout if self.training else 0.0

    def linears(self):
        return (self.Wqkv,)  # one Linear: its weight is all three's

    def project(self, hidden):
        """q, k, v each [B, heads, S, d] (padded hidden [B, S, H]) or [T, heads, d] (packed [T, H])."""
        config, Wqkv = self.config, self.Wqkv
        if is_plain_linear(Wqkv):
            return ops.qkv_projection(hidden, *weight_and_bias(Wqkv), config.num_attention_heads,
                                      backend=config.backend)
        qkv = Wqkv(hidden).view(*hidden.shape[:-1], 3, config.num_attention_heads, config.head_dim)
        projected = qkv.unbind(dim=-3)
        return projected if hidden.dim() == 2 else [t.transpose(1, 2) for t in projected]

    def attention_options(self) -> dict:
        return {"rotary_base": self.rotary_base, "window": self.window}


class ModernBertMLP(nn.Module):
    """Wo(dropout(gelu(input) * gate)) with input, gate = Wi(x).chunk(2): one fused op (the GeGLU in the
    up-projection's epilogue) for plain Linears without mlp dropout in training; else the modules. forward's
    residual (the layer's stream, which the layer passes where no hook would see this module's output) is
    added to the output by the fused op's down-projection, and may be overwritten with the result: in an
    inference forward the GEMM accumulates onto it (ops.feed_forward's residual_in_place)."""
    Wi, drop, Wo = Submodule(), Submodule(), Submodule()

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden, recompute: bool = False, residual=None):
        c, Wi, Wo = self.config, self.Wi, self.Wo
        if is_plain_linear(Wi) and is_plain_linear(Wo) and dropout_rate(self.drop) == 0.0:
            return ops.feed_forward_geglu(hidden, *weight_and_bias(Wi), *weight_and_bias(Wo), c.gelu_approximate,
                                          recompute_pre=recompute, backend=c.backend, residual=residual,
                                          residual_in_place=True)

        def unfused(x):
            value, gate = Wi(x).chunk(2, dim=-1)
            gated = F.gelu(value, approximate=c.gelu_approximate) * gate
            return Wo(run_dropout(self.drop, gated, c))
        out = _recompute(unfused, hidden) if recompute else unfused(hidden)
        return out if residual is None else residual + out


class ModernBertEncoderLayer(EncoderLayer):
    """Pre-LayerNorm: (stream, mlp input) = mlp_norm-and-add(Wo(attention(attn_norm(x))), x) in one fused
    LayerNorm, then stream + mlp(mlp input). The first layer has no attn_norm (the embeddings' norm is it)."""
    attn_norm, attn, mlp_norm, mlp = Submodule(), Submodule(), Submodule(), Submodule()

    def __init__(self, config: ModernBertConfig, layer: int):
        super().__init__()
        self.config = config
        self.attn_norm = (nn.Identity() if layer == 0 else
                          nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias))
        self.attn = ModernBertAttention(config, layer)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.mlp = ModernBertMLP(config)

    def attention_block(self, hidden, layout: AttentionLayout, output_attentions: bool):
        c, attention, pre_norm = self.config, self.attn, self.attn_norm
        pre_norm = None if isinstance(pre_norm, nn.Identity) else pre_norm
        if (not output_attentions and torch.is_grad_enabled() and one_node_sublayers(c, hidden)
                and is_unhooked(attention, ModernBertAttention)):
            attended = attention.sublayer(hidden, layout, attention.Wo, self.mlp_norm, attention.out_drop, pre_norm,
                                          return_residual=True)
            if attended is not None:  # one autograd node (fastbert/sublayer.py)
                mlp_input, stream = attended
                return (stream, mlp_input), None
        normed = hidden if pre_norm is None else layer_norm(c, pre_norm, hidden)
        context, probs = attention(normed, layout, output_attentions)
        mlp_input, stream = add_and_norm(c, self.mlp_norm, linear(attention.Wo, context), hidden, attention.out_drop,
                                         return_residual=True)
        return (stream, mlp_input), probs

    def feed_forward(self, attended, recompute: bool = False):
        stream, mlp_input = attended
        mlp = self.mlp
        if is_unhooked(mlp, ModernBertMLP):  # no hook to see the MLP's own output: the stream joins its op
            return mlp.forward(mlp_input, recompute, residual=stream)
        return stream + mlp(mlp_input, recompute)


class ModernBertLayers(nn.ModuleList):
    """The model's `layers` list, run as an encoder (modeling.run_layers: checkpointing, hidden states)."""

    def __init__(self, config: ModernBertConfig):
        super().__init__(ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.config = config
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None
        self.checkpointed_every = 1  # BertEncoder's

    def forward(self, hidden, layout: AttentionLayout, output_hidden_states=False, output_attentions=False):
        return run_layers(self, self, hidden, layout, output_hidden_states, output_attentions)


class ModernBertPreTrainedModel(BertPreTrainedModel):
    config_class = ModernBertConfig
    base_model_prefix = "model"
    _no_split_modules = ["ModernBertEmbeddings", "ModernBertEncoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Truncated normal weights (cut at initializer_cutoff_factor standard deviations, as transformers'
        ModernBERT), zero biases, LayerNorms at one."""
        std = self.config.initializer_range
        cutoff = self.config.initializer_cutoff_factor * std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, mean=0.0, std=std, a=-cutoff, b=cutoff)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Module:
        return self._bert().embeddings.tok_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self._bert().embeddings.tok_embeddings = value


class ModernBertModel(ModernBertPreTrainedModel, BertModel):
    """Embeddings, the layers and final_norm. Takes BertModel's layouts (padded with attention_mask, packed
    with cu_seqlens); position_ids, if given, must count up by one within each sequence (each token's offset
    in its sequence up to a constant, which rotates as the offsets do): others are an error, never ignored."""
    takes_cache = False

    def __init__(self, config: ModernBertConfig, add_pooling_layer: bool = True):
        config.validate()
        BertPreTrainedModel.__init__(self, config)
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = ModernBertLayers(config)
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.post_init()

    def encode(self, hidden, layout: AttentionLayout, output_hidden_states, output_attentions):
        hidden, all_hidden, all_probs = self.layers(hidden, layout, output_hidden_states, output_attentions)
        hidden = layer_norm(self.config, self.final_norm, hidden)
        if all_hidden is not None and all_hidden[-1] is not None:  # transformers' last one is after final_norm
            all_hidden[-1] = hidden
        return hidden, all_hidden, all_probs

    def pool(self, sequence_output):
        return None

    def unpads(self, hidden) -> bool:
        """On the kernels only: the PyTorch path's varlen attention would pad each layer back, to twice the batch
        (each sequence's padding a sequence of its own), costing two copies a layer and double the attention for
        the same rows; padded, it runs as transformers' SDPA ModernBERT does."""
        return ops.resolve_backend(self.config.backend, hidden) != "torch"

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        """transformers' ModernBertModel arguments; the rest as BertModel.forward."""
        kwargs.pop("token_type_ids", None)  # transformers' ModernBERT takes and ignores them
        if position_ids is not None and kwargs.get("validate", True):
            _check_offsets(position_ids, attention_mask, kwargs)
        return BertModel.forward(self, input_ids, attention_mask, None, None, inputs_embeds, **kwargs)


def _check_offsets(position_ids, attention_mask, kwargs) -> None:
    """ValueError where position_ids are not each token's offset in its sequence up to a constant per sequence
    (rotary scores depend on i - j only, so 0, 1, ... and k, k + 1, ... give the same result in transformers
    and in fastbert: transformers' row indices for left padding, offsets from 1 for packing). Padding
    positions are free."""
    cu_seqlens = kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q"))
    if cu_seqlens is not None:  # packed [1, T]: the shift at each token's sequence start
        tokens = torch.arange(position_ids.shape[-1], device=position_ids.device)
        starts = cu_seqlens.to(tokens.device)[torch.searchsorted(cu_seqlens[1:].to(tokens.device), tokens,
                                                                 right=True)]
        shift = position_ids - (tokens - starts)  # [1, T]
        first = shift[..., starts]
        real = torch.ones_like(position_ids, dtype=torch.bool)
    else:  # padded [B, S] (or [1, S]): the shift at each row's first token
        shift = position_ids - torch.arange(position_ids.shape[-1], device=position_ids.device)
        mask = key_padding_mask(attention_mask, validate=False)
        real = torch.ones_like(shift, dtype=torch.bool) if mask is None else mask.bool()
        shift = shift.expand(*real.shape)
        first = shift.gather(-1, real.int().argmax(dim=-1, keepdim=True))  # [B, 1]
    check_on_device(((shift == first) | ~real).all(),
                    "ModernBERT's position_ids must count up by one within each sequence (0, 1, ... or from any "
                    "start): fastbert rotates q and k by each token's offset in its sequence inside the attention "
                    "kernel, which equals the rotation by such positions")


class ModernBertPredictionHead(nn.Module):
    """norm(act(dense(x))), act = config.classifier_activation."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)

    def forward(self, hidden):
        return gelu_dense_norm(self.config, self.dense, self.norm, hidden,
                               GELU_APPROXIMATION[self.config.classifier_activation])


class ModernBertForMaskedLM(ModernBertPreTrainedModel, BertForMaskedLM):
    """head -> decoder tied to the word embeddings (with decoder_bias); the masked-only fused loss, mask_token_id
    and return_logits as BertForMaskedLM."""

    _tied_weights_keys = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}
    decoder_path, bias_path = "decoder", "decoder.bias"

    def __init__(self, config: ModernBertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)
        self.post_init()

    def vocabulary_head(self) -> VocabularyHead:
        return VocabularyHead(self.config, self.head, self.decoder, self.decoder.bias, bias_in_decoder=True)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                *, return_dict=None, **kwargs):
        """BertForMaskedLM's; with config.sparse_prediction and labels the logits are those of the labelled
        tokens only, [N, vocab] (transformers' sparse_prediction; the loss is the same masked-only loss): a token
        labelled sparse_pred_ignore_index is left out of both (one labelled -100 only out of the loss)."""
        kwargs.pop("token_type_ids", None)
        sparse = self.config.sparse_prediction and labels is not None
        kept = sparse and labels != self.config.sparse_pred_ignore_index  # transformers drops the rest before its loss
        result = BertForMaskedLM.forward(self, input_ids, attention_mask, None, position_ids, inputs_embeds,
                                         labels.masked_fill(~kept, -100) if sparse else labels, return_dict=True,
                                         **kwargs)
        if sparse and result.logits is not None:
            result.logits = result.logits[kept]  # [N, vocab]
        return self._outputs(result, return_dict)


class ModernBertClassifier(ModernBertPreTrainedModel):
    """model -> features -> head -> dropout -> classifier, ModernBERT's classification heads' one forward; a
    head gives its features (`features`), its loss and its output class."""

    output_class = outputs.SequenceClassifierOutput

    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.drop = HeadDropout(config.classifier_dropout, config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def features(self, hidden, attention_mask):
        raise NotImplementedError

    def loss(self, logits, labels, attention_mask, validate: bool):
        raise NotImplementedError

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None, *,
                output_hidden_states=None, output_attentions=None, return_dict=None, validate=True, **kwargs):
        base = self.model(input_ids, attention_mask, position_ids, inputs_embeds,
                          output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                          return_dict=True, validate=validate, **kwargs)
        features = self.features(base.last_hidden_state, attention_mask)
        logits = self.classifier(self.drop(self.head(features)))
        result = self.output_class(loss=self.loss(logits, labels, attention_mask, validate), logits=logits,
                                   hidden_states=base.hidden_states, attentions=base.attentions)
        return self._outputs(result, return_dict)


class ModernBertForSequenceClassification(ModernBertClassifier):
    """Pooled (config.classifier_pooling: the first token, or the mean over the real tokens) -> head -> dropout
    -> classifier: logits [B, num_labels]; the loss as BertForSequenceClassification's (transformers'
    problem_type rules)."""

    def features(self, hidden, attention_mask):
        if self.config.classifier_pooling != "mean":
            return hidden[:, 0]  # [B, H]
        mask = key_padding_mask(attention_mask, validate=False)
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask.to(hidden.dtype)
        return (hidden * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True)  # [B, H]

    def loss(self, logits, labels, attention_mask, validate: bool):
        return sequence_classification_loss(self.config, logits, labels, validate)


class ModernBertForTokenClassification(ModernBertClassifier):
    """head -> dropout -> classifier per token: logits [B, S, num_labels]; the loss as
    BertForTokenClassification's."""

    output_class = outputs.TokenClassifierOutput

    def features(self, hidden, attention_mask):
        return hidden

    def loss(self, logits, labels, attention_mask, validate: bool):
        return token_classification_loss(logits, labels, attention_mask, validate)


MODERNBERT_CLASSES = {cls.__name__: cls for cls in (
    ModernBertModel, ModernBertForMaskedLM, ModernBertForSequenceClassification, ModernBertForTokenClassification)}
