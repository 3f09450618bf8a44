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

    def validate(self) -> None:
        super().validate()
        # transformers' MPNetEmbeddings fixes its padding index at 1 (word and position tables, position ids from
        # 2) whatever pad_token_id says; fastbert's embeddings read pad_token_id, so another value would count
        # positions from elsewhere
        if self.pad_token_id != MPNET_PADDING_INDEX:
            raise ValueError(f"MPNetConfig.pad_token_id must be {MPNET_PADDING_INDEX} (transformers' MPNet counts "
                             f"positions from padding index {MPNET_PADDING_INDEX} whatever pad_token_id says), "
                             f"got {self.pad_token_id!r}")
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

    def __init__(self, **kwargs: Any):
        super().__init__(**self.from_hf_names(kwargs))

    def validate(self) -> None:
        # transformers' DistilBERT also takes activation="relu", which fastbert's fused FFN does not compute:
        # named as config.json and transformers spell the field, not as BertConfig's hidden_act
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(f"DistilBertConfig.activation {self.hidden_act!r} is not supported; expected one of "
                             f"{sorted(GELU_APPROXIMATION)}")
        super().validate()

    @classmethod
    def from_hf_names(cls, values: dict[str, Any]) -> dict[str, Any]:
        return {DISTILBERT_NAMES.get(k, k): v for k, v in values.items()}

    def to_hf_names(self, values: dict[str, Any]) -> dict[str, Any]:
        ours = {v: k for k, v in DISTILBERT_NAMES.items()}
        return {ours.get(k, k): v for k, v in values.items()}

    def __getattr__(self, name: str):
        if name in DISTILBERT_NAMES:  # only reached for names the instance lacks: transformers' spelling
            return getattr(self, DISTILBERT_NAMES[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


FAMILY_CONFIGS = (BertConfig, RobertaConfig, XLMRobertaConfig, CamembertConfig, ElectraConfig, MPNetConfig,
                  DistilBertConfig)
