"""BertConfig: HF BertConfig's fields and defaults as a dataclass, plus fastbert's switches.

`from_json` / `to_json` read and write HF's config.json; keys fastbert does not model are kept
in `extra` and written back, so a config survives a round trip through fastbert unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# hidden_act -> the `approximate` argument of GELU ("none" = exact erf form)
GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
BACKENDS = ("auto", "triton", "torch")
# HF keys that change the architecture: a checkpoint that sets them otherwise must not load silently
UNSUPPORTED_IF_NOT = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}
# fastbert's own fields: never written to HF's config.json
FASTBERT_FIELDS = ("backend", "unpad", "extra")


@dataclass
class BertConfig:
    vocab_size: int = 30522  # WordPiece vocabulary size
    hidden_size: int = 768  # H: width of every token's hidden state
    num_hidden_layers: int = 12  # L: encoder layers
    num_attention_heads: int = 12  # heads; hidden_size must divide by it
    intermediate_size: int = 3072  # FFN inner width (4H in the paper)
    hidden_act: str = "gelu"  # "gelu" = exact erf GELU; "gelu_new" / "gelu_pytorch_tanh" = tanh approximation
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and every sublayer output
    attention_probs_dropout_prob: float = 0.1  # dropout on the attention probabilities
    max_position_embeddings: int = 512  # longest sequence the position table covers
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    initializer_range: float = 0.02  # std of the normal init of every weight matrix
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon (HF's BERT default)
    pad_token_id: int = 0  # padding token; its embedding row is initialised to zero
    classifier_dropout: float | None = None  # dropout before task heads; None = hidden_dropout_prob
    num_labels: int = 2  # output size of the sequence / token classification heads
    problem_type: str | None = None  # HF's: "regression", "single_label_classification", "multi_label_classification"
    backend: str = "auto"  # "auto" | "triton" | "torch": which implementation fastbert.ops runs
    unpad: bool = False  # run the encoder on packed tokens only (padding removed once after the embeddings)
    extra: dict[str, Any] = field(default_factory=dict)  # HF keys fastbert does not model, kept for round trips

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and the limit for any invalid setting."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(
                f"BertConfig.hidden_act {self.hidden_act!r} is not supported; "
                f"expected one of {sorted(GELU_APPROXIMATION)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {value!r}")
        if not self.initializer_range > 0:
            raise ValueError(f"BertConfig.initializer_range must be > 0, got {self.initializer_range!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"BertConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"BertConfig.pad_token_id ({self.pad_token_id}) must be in [0, vocab_size={self.vocab_size})")

    @property
    def gelu_approximate(self) -> str:
        return GELU_APPROXIMATION[self.hidden_act]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # presets ------------------------------------------------------------------------------------
    @classmethod
    def base(cls, **overrides: Any) -> "BertConfig":
        """BERT-base: L=12, H=768, A=12 (110M parameters)."""
        return cls(**overrides)

    @classmethod
    def large(cls, **overrides: Any) -> "BertConfig":
        """BERT-large: L=24, H=1024, A=16 (340M parameters)."""
        values = dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096)
        return cls(**{**values, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> "BertConfig":
        """A 2-layer, H=128 model for tests and smoke runs."""
        values = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=512, max_position_embeddings=128)
        return cls(**{**values, **overrides})

    def replace(self, **overrides: Any) -> "BertConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **overrides)

    # HF config.json -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> "BertConfig":
        """Build from HF config.json's dict; keys fastbert does not model go to `extra`."""
        values = {**values, **overrides}
        for key, supported in UNSUPPORTED_IF_NOT.items():
            if key in values and values[key] != supported:
                raise ValueError(f"config {key}={values[key]!r} is not supported: fastbert implements BERT's "
                                 f"encoder with {key}={supported!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in values.items() if k in known}
        extra = {k: v for k, v in values.items() if k not in known}
        if "id2label" in values and "num_labels" not in values:
            kwargs["num_labels"] = len(values["id2label"])
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "BertConfig":
        """Read an HF config.json (a file, or a directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), **overrides)

    def to_dict(self) -> dict[str, Any]:
        """HF config.json's dict: fastbert-only fields left out, unknown HF keys kept."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in FASTBERT_FIELDS}
        values = {**self.extra, **values}
        values.setdefault("model_type", "bert")
        values.setdefault("position_embedding_type", "absolute")
        id2label = self.extra.get("id2label")
        if id2label is None or len(id2label) != self.num_labels:  # num_labels changed: default names
            id2label = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        values["id2label"] = id2label
        values["label2id"] = {v: int(k) for k, v in values["id2label"].items()}
        return values

    def to_json(self, path: str | os.PathLike) -> None:
        """Write HF config.json (a file path, or a directory to write config.json into)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
