"""The configs of BERT's family: each is BertConfig with the architecture's model_type, its transformers
defaults and its switches (fastbert.config.BertConfig's class attributes); DistilBERT also has its own names
in config.json. A config reads and writes the architecture's config.json as transformers' class does.
"""
from __future__ import annotations

from typing import Any

from fastbert.config import GELU_APPROXIMATION, BertConfig

# RoBERTa's defaults in transformers (roberta-base's own config.json sets max_position_embeddings=514,
# type_vocab_size=1 and layer_norm_eps=1e-5)
ROBERTA_DEFAULTS = {"vocab_size": 50265, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}


class RobertaConfig(BertConfig):
    model_type = "roberta"
    architecture = "RoBERTa"
    positions_from_padding = True
    defaults = ROBERTA_DEFAULTS


class XLMRobertaConfig(RobertaConfig):
    model_type = "xlm-roberta"
    architecture = "XLM-RoBERTa"
    defaults = {**ROBERTA_DEFAULTS, "vocab_size": 30522}


class CamembertConfig(RobertaConfig):
    model_type = "camembert"
    architecture = "CamemBERT"
    defaults = {**ROBERTA_DEFAULTS, "vocab_size": 30522}


class ElectraConfig(BertConfig):
    """ELECTRA: embedding tables of embedding_size, projected to hidden_size by the model's
    embeddings_project where the two differ."""

    model_type = "electra"
    architecture = "ELECTRA"
    defaults = {"embedding_size": 128, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
                "summary_type": "first", "summary_use_proj": True, "summary_activation": "gelu",
                "summary_last_dropout": 0.1}


# transformers' MPNet buckets key-minus-query distances into 32 buckets up to 128 tokens apart, whatever
# relative_attention_num_buckets says (its compute_position_bias keeps its defaults)
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128
MPNET_PADDING_INDEX = 1  # transformers' MPNetEmbeddings.padding_idx, a constant there


class MPNetConfig(BertConfig):
    """MPNet: no token types, positions from the padding index, and a relative-position bias in attention
    (relative_attention_num_buckets per head, bucketed as transformers does)."""

    model_type = "mpnet"
    architecture = "MPNet"
    positions_from_padding = True
    defaults = {"vocab_size": 30527, "pad_token_id": 1, "bos_token_id": 0,
                "eos_token_id": 2, "relative_attention_num_buckets": 32, "type_vocab_size": 0}
    absent_fields = ("type_vocab_size", "classifier_dropout")

    @property
    def padding_index(self) -> int:
        """transformers' MPNetEmbeddings fixes its padding index at 1 (the word and position tables' padding
        rows, position ids from 2) whatever pad_token_id says."""
        return MPNET_PADDING_INDEX

    def validate(self) -> None:
        super().validate()
        if self.relative_attention_num_buckets < MPNET_BUCKETS:
            raise ValueError(f"MPNetConfig.relative_attention_num_buckets must be >= {MPNET_BUCKETS} (the buckets "
                             f"transformers' MPNet computes), got {self.relative_attention_num_buckets}")


# DistilBERT's config.json names -> BertConfig's
DISTILBERT_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                    "hidden_dim": "intermediate_size", "dropout": "hidden_dropout_prob",
                    "attention_dropout": "attention_probs_dropout_prob", "activation": "hidden_act"}


class DistilBertConfig(BertConfig):
    """DistilBERT: no token types, no pooler, LayerNorm eps 1e-12; config.json (and transformers' attribute
    names, also readable here: config.dim, config.n_layers, ...) use its own names (DISTILBERT_NAMES)."""

    model_type = "distilbert"
    architecture = "DistilBERT"
    defaults = {"num_hidden_layers": 6, "type_vocab_size": 0, "sinusoidal_pos_embds": False, "qa_dropout": 0.1,
                "seq_classif_dropout": 0.2}
    absent_fields = ("type_vocab_size", "layer_norm_eps", "classifier_dropout")
    hf_names = DISTILBERT_NAMES

    def validate(self) -> None:
        # transformers' DistilBERT also takes activation="relu", which fastbert's fused FFN does not compute:
        # named as config.json and transformers spell the field, not as BertConfig's hidden_act
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(f"DistilBertConfig.activation {self.hidden_act!r} is not supported; expected one of "
                             f"{sorted(GELU_APPROXIMATION)}")
        super().validate()


# ModernBERT's config.json names -> BertConfig's (the fields the two share)
MODERNBERT_NAMES = {"hidden_activation": "hidden_act", "norm_eps": "layer_norm_eps",
                    "attention_dropout": "attention_probs_dropout_prob"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def layer_pattern(layers: int, every: int) -> list[str]:
    """ModernBERT's layer_types: global attention on every `every`-th layer from the first, local elsewhere."""
    return [FULL_ATTENTION if i % every == 0 else SLIDING_ATTENTION for i in range(layers)]


class ModernBertConfig(BertConfig):
    """ModernBERT (Warner et al., 2024): pre-LayerNorm without biases, rotary positions, a GeGLU feed-forward,
    global attention every global_attn_every_n_layers-th layer and a sliding window of local_attention tokens
    (|i - j| <= local_attention / 2) on the others. transformers' names and defaults; its config.json's
    global_rope_theta / local_rope_theta (older checkpoints) or rope_parameters (transformers 5) both read.
    unpad is always True: unpadded on the kernels (the PyTorch path stays padded, ModernBertModel.unpads)."""

    model_type = "modernbert"
    architecture = "ModernBERT"
    position_table = False  # rotary positions
    defaults = {"vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
                "max_position_embeddings": 8192, "layer_norm_eps": 1e-5, "pad_token_id": 50283,
                "eos_token_id": 50282, "bos_token_id": 50281, "cls_token_id": 50281, "sep_token_id": 50282,
                "type_vocab_size": 0, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                "classifier_dropout": 0.0, "initializer_cutoff_factor": 2.0, "norm_bias": False,
                "attention_bias": False, "local_attention": 128, "embedding_dropout": 0.0,
                "mlp_bias": False, "mlp_dropout": 0.0, "decoder_bias": True, "classifier_pooling": "cls",
                "classifier_bias": False, "classifier_activation": "gelu", "deterministic_flash_attn": False,
                "sparse_prediction": False, "sparse_pred_ignore_index": -100, "layer_types": None,
                "rope_parameters": None, "unpad": True}
    absent_fields = ("type_vocab_size", "hidden_dropout_prob")
    hf_names = MODERNBERT_NAMES

    def __init__(self, **kwargs: Any):
        every = kwargs.pop("global_attn_every_n_layers", 3)
        global_theta = kwargs.pop("global_rope_theta", 160000.0)
        local_theta = kwargs.pop("local_rope_theta", 10000.0)
        super().__init__(**kwargs)
        if self.layer_types is None:
            self.layer_types = layer_pattern(self.num_hidden_layers, every)
        if self.rope_parameters is None:
            self.rope_parameters = {SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": local_theta},
                                    FULL_ATTENTION: {"rope_type": "default", "rope_theta": global_theta}}

    def update_known(self, overrides: dict[str, Any], caller: str, validate: bool = True) -> None:
        """BertConfig.update_known; a new num_hidden_layers without layer_types gets layer_types in the same
        pattern (global every n-th layer, n read from the current list)."""
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            fulls = [i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION]
            every = fulls[1] - fulls[0] if len(fulls) > 1 else len(self.layer_types)
            overrides = {**overrides, "layer_types": layer_pattern(overrides["num_hidden_layers"], every)}
        super().update_known(overrides, caller, validate)

    def convert_rope_params_to_dict(self, **kwargs: Any) -> dict[str, Any]:
        """transformers' PreTrainedConfig would flatten rope_parameters to one layer type here; __init__ above
        reads ModernBERT's two."""
        return kwargs


    # presets ----------------------------------------------------------------------------------------
    @classmethod
    def base(cls, **overrides: Any) -> "ModernBertConfig":
        """ModernBERT-base: 22 layers, hidden 768, GeGLU 1152, 12 heads (149M parameters)."""
        return cls(**overrides)

    @classmethod
    def large(cls, **overrides: Any) -> "ModernBertConfig":
        """ModernBERT-large: 28 layers, hidden 1024, GeGLU 2624, 16 heads (395M parameters)."""
        values = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=2624, num_attention_heads=16)
        return cls(**{**values, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> "ModernBertConfig":
        """3 layers (one global, two local with a 32-token window), hidden 128, for tests and smoke runs."""
        values = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=3, num_attention_heads=2,
                      intermediate_size=192, max_position_embeddings=128, local_attention=32, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        return cls(**{**values, **overrides})

    @property
    def sliding_window(self) -> int:
        """A local layer's half window: keys with |i - j| <= sliding_window (transformers' own attribute)."""
        return self.local_attention // 2

    def layer_rope_base(self, layer: int) -> float:
        return float(self.rope_parameters[self.layer_types[layer]]["rope_theta"])

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def validate(self) -> None:
        # transformers' ModernBertMLP takes any activation; fastbert's GeGLU computes a GELU: named as config.json
        # and transformers spell the field, not as BertConfig's hidden_act
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(f"ModernBertConfig.hidden_activation {self.hidden_act!r} is not supported; expected one "
                             f"of {sorted(GELU_APPROXIMATION)}")
        super().validate()
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {FULL_ATTENTION,
                                                                                           SLIDING_ATTENTION}:
            raise ValueError(f"ModernBertConfig.layer_types must hold num_hidden_layers={self.num_hidden_layers} "
                             f"of {FULL_ATTENTION!r} / {SLIDING_ATTENTION!r}, got {self.layer_types!r}")
        for layer_type, parameters in self.rope_parameters.items():
            if parameters.get("rope_type", "default") != "default":
                raise ValueError(f"ModernBertConfig.rope_parameters[{layer_type!r}] rope_type "
                                 f"{parameters['rope_type']!r} is not supported: fastbert rotates with the default "
                                 "RoPE")
        if self.classifier_activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"ModernBertConfig.classifier_activation must be a GELU, got "
                             f"{self.classifier_activation!r}")
        if not self.unpad:
            raise ValueError("ModernBertConfig.unpad must be True: fastbert runs ModernBERT unpadded on its kernels")


FAMILY_CONFIGS = (BertConfig, RobertaConfig, XLMRobertaConfig, CamembertConfig, ElectraConfig, MPNetConfig,
                  DistilBertConfig, ModernBertConfig)
