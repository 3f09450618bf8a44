"""BertConfig: HF BertConfig's fields and defaults, plus fastbert's switches.

Where transformers imports, BertConfig is a transformers `PreTrainedConfig` (model_type "bert"), so
its ecosystem reads it as it reads its own (id2label, num_labels, output_hidden_states, get_text_config,
...). `from_json` / `to_json` read and write HF's config.json; keys fastbert does not model stay attributes
and are written back, so a config survives a round trip through fastbert unchanged. fastbert's own
switches (FASTBERT_FIELDS) are never written to config.json.
"""
from __future__ import annotations

import copy
import inspect
import json
import numbers
import os
from typing import Any

import torch

from fastbert.bases import COMMON_CONFIG_DEFAULTS, ConfigBase
from fastbert.outputs import FASTBERT_OUTPUTS
from fastbert.ops import LAYER_NORM_SAVES

# hidden_act -> the `approximate` argument of GELU ("none" = exact erf form)
GELU_APPROXIMATION = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                      "gelu_fast": "tanh"}
BACKENDS = ("auto", "triton", "torch")
# HF keys that change the architecture: a checkpoint that sets them otherwise must not load silently
UNSUPPORTED_IF_NOT = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}
# fastbert's own switches: never written to HF's config.json
FASTBERT_FIELDS = ("backend", "unpad", "max_predictions_per_seq", "activation_checkpointing", "layer_norm_backward")
# what each encoder layer recomputes in the backward instead of keeping (fastbert.train.metrics
# recompute_flops_per_token gives each option's extra forward FLOPs)
ACTIVATION_CHECKPOINTING = ("none", "attention", "ffn", "full")
BERT_MODEL_TYPE = "bert"


class BertConfig(ConfigBase):
    """BERT's hyper-parameters (keyword arguments only), validated when a model is built from them.

    Unknown keyword arguments become attributes, as in transformers; `num_labels` follows `id2label`.
    """

    model_type = BERT_MODEL_TYPE
    architecture = "BERT"  # the name messages use
    # transformers' Trainer leaves these outputs out of the predictions it gathers at evaluation
    keys_to_ignore_at_inference = list(FASTBERT_OUTPUTS)

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
    pad_token_id: int | None = 0  # padding token; its embedding row is initialised to zero (None: no such row)
    classifier_dropout: float | None = None  # dropout before task heads; None = hidden_dropout_prob
    tie_word_embeddings: bool = True  # the MLM decoder shares the word embedding matrix
    backend: str = "auto"  # "auto" | "triton" | "torch": which implementation fastbert.ops runs
    unpad: bool = False  # run the encoder on packed tokens only (padding removed once after the embeddings)
    # MLM loss with labels: 0 = exactly the labelled positions (a data-dependent size: one host sync);
    # K > 0 = a fixed budget of K positions per sequence (Google BERT's max_predictions_per_seq): static
    # shapes, no host sync, torch.compile / export friendly; more labels than K in a sequence is an error
    max_predictions_per_seq: int = 0
    # recomputed in the backward while training, read at forward time: "none"; "attention" (the QKV
    # projection, attention, output projection and its LayerNorm keep only their input); "ffn" (the FFN
    # keeps only its input, its up-projection rerun); "full" (each layer keeps only its input; what
    # gradient_checkpointing_enable() also selects)
    activation_checkpointing: str = "none"
    # what the Triton LayerNorm's backward works from (ops.layer_norm's save=): "output" keeps y and rstd
    # (exact while a LayerNorm has at most 8 weights of |w| < 1/4, NaN gradients beyond); "input" keeps x and
    # the residual (2 more activations per LayerNorm, exact for any weights). from_pretrained and
    # fastbert.apply choose "input" for weights "output" cannot serve (fastbert.hf.choose_layer_norm_backward)
    layer_norm_backward: str = "output"

    # transformers' BertConfig attributes for what fastbert does not implement, at transformers' defaults;
    # class attributes, so config.json gets them only where the source set them
    is_decoder = False
    add_cross_attention = False
    position_embedding_type = "absolute"
    use_cache = True
    bos_token_id = None
    eos_token_id = None

    # The family (fastbert.family_config): an architecture's config is a subclass that changes these
    # class attributes and `defaults`, never the encoder.
    # position ids count from pad_token_id + 1, padding keeping pad_token_id (RoBERTa, MPNet)
    positions_from_padding = False
    # a learned position table of max_position_embeddings rows, which limits the sequence length (ModernBERT's
    # rotary positions have none: transformers runs it on longer sequences)
    position_table = True
    # field defaults other than BertConfig's (the architecture's, as transformers' config class has them),
    # including fields BERT lacks (ELECTRA's embedding_size)
    defaults = {}  # type: dict[str, Any]  (no annotation: not a config field)
    # fields the architecture's config.json does not have (DistilBERT and MPNet have no token types)
    absent_fields = ()  # type: tuple[str, ...]
    # the architecture's config.json names -> BertConfig's, for the fields they share (DistilBERT's dim, ...);
    # both spellings are taken by the constructor and readable as attributes, config.json gets the former
    hf_names = {}  # type: dict[str, str]

    def __init__(self, **kwargs: Any):
        kwargs = self.from_hf_names(kwargs)
        check_field_types(type(self), kwargs)
        for name, default in {**OWN_FIELDS, **self.defaults}.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(**kwargs)
        # BERT's fields are checked when a model is built (BertModel.__init__), as transformers' configs take
        # what a model then refuses; fastbert's own switches, which transformers never sees, are checked now
        self.validate_switches()

    def __init_subclass__(cls, **kwargs: Any):
        own = {name: cls.__dict__[name] for name in ("__init__", "__eq__") if name in cls.__dict__}
        super().__init_subclass__(**kwargs)
        # transformers makes every config subclass a dataclass with a generated __init__ and __eq__; an
        # architecture's config (fastbert.family_config) keeps BertConfig's, which read its `defaults`
        for name in ("__init__", "__eq__"):
            setattr(cls, name, own.get(name, getattr(BertConfig, name)))
        if getattr(cls, "attribute_map", None) and "__getattribute__" not in cls.__dict__:
            cls.__getattribute__ = ConfigBase.__getattribute__  # aliases: read transformers' way

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and the limit for any invalid setting (a model built
        from the config calls it; so do replace and from_pretrained's overrides)."""
        for key, supported in UNSUPPORTED_IF_NOT.items():
            if getattr(self, key) != supported:
                raise ValueError(f"config {key}={getattr(self, key)!r} is not supported: fastbert implements "
                                 f"BERT's encoder with {key}={supported!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels",
                     "embedding_width"):
            value = getattr(self, name)
            smallest = 0 if name == "type_vocab_size" else 1  # 0: no token type table (DistilBERT, MPNet)
            if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= {smallest}, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{type(self).__name__}.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(
                f"{type(self).__name__}.hidden_act {self.hidden_act!r} is not supported; "
                f"expected one of {sorted(GELU_APPROXIMATION)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{type(self).__name__}.{name} must be in [0, 1), got {value!r}")
        if not self.initializer_range > 0:
            raise ValueError(f"{type(self).__name__}.initializer_range must be > 0, got {self.initializer_range!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"{type(self).__name__}.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:  # None: no padding row
            raise ValueError(f"{type(self).__name__}.pad_token_id ({self.pad_token_id}) must be None or in "
                             f"[0, vocab_size={self.vocab_size})")
        self.validate_switches()

    def validate_switches(self) -> None:
        """ValueError naming the switch, the value and the choices for fastbert's own fields (FASTBERT_FIELDS)."""
        if self.backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"{type(self).__name__}.activation_checkpointing must be one of "
                             f"{ACTIVATION_CHECKPOINTING}, got {self.activation_checkpointing!r}")
        if self.layer_norm_backward not in LAYER_NORM_SAVES:
            raise ValueError(f"{type(self).__name__}.layer_norm_backward must be one of {LAYER_NORM_SAVES}, "
                             f"got {self.layer_norm_backward!r}")
        budget = self.max_predictions_per_seq
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"{type(self).__name__}.max_predictions_per_seq must be an integer >= 0 (0 = every "
                             f"labelled position), got {budget!r}")

    @property
    def gelu_approximate(self) -> str:
        return GELU_APPROXIMATION[self.hidden_act]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_width(self) -> int:
        """Width of the embedding tables: ELECTRA's embedding_size where it has one, else hidden_size."""
        return getattr(self, "embedding_size", None) or self.hidden_size

    @property
    def padding_index(self) -> int | None:
        """The embedding tables' padding row and the id position ids count from: pad_token_id (MPNet fixes its
        own)."""
        return self.pad_token_id

    @property
    def position_offset(self) -> int:
        """The position id of a sequence's first token: padding_index + 1 where positions count from the
        padding index (RoBERTa, MPNet), else 0."""
        return self.padding_index + 1 if self.positions_from_padding else 0

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence the position table covers (RoBERTa's 514 positions hold 512 tokens)."""
        return self.max_position_embeddings - self.position_offset

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.config_json().items() if k not in ("id2label", "label2id", "model_type")}
        fastbert = {name: getattr(self, name) for name in FASTBERT_FIELDS}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in {**changed, **fastbert}.items())})"

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
        """A copy with some attributes changed (validated); each must be an attribute the config has."""
        config = copy.deepcopy(self)
        config.update_known(overrides, "BertConfig.replace")
        return config

    def update_known(self, overrides: dict[str, Any], caller: str, validate: bool = True) -> None:
        """Set attributes the config already has (fields, HF's common fields, keys of its config.json),
        then validate (validate=False: fastbert's own switches only, as a config read from config.json is
        taken as transformers takes it, and checked when a model is built). An unknown name is a TypeError:
        it is a typo or a setting this config does not hold, never a new key to write into config.json."""
        unknown = sorted(k for k in overrides if not hasattr(self, k))
        if unknown:
            raise TypeError(f"{caller} got unknown argument(s) {unknown}: not a field of BertConfig "
                            f"(e.g. {', '.join(list(OWN_FIELDS)[:4])}, num_labels, id2label)")
        for key, value in overrides.items():
            setattr(self, key, value)
        if validate:
            self.validate()
        else:
            self.validate_switches()

    # HF config.json -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> "BertConfig":
        """Build from HF config.json's dict (refusing non-BERT model types), then apply `overrides`, each a
        field or a key the dict holds (as transformers' from_pretrained applies its keyword arguments). Sizes
        a model refuses (hidden_size not divisible by num_attention_heads, ...) load, as in transformers: the
        model build names them."""
        values = dict(values)
        model_type = values.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"model_type {model_type!r} is not {cls.architecture}: {cls.__name__} reads "
                             f"model_type {cls.model_type!r} (fastbert.architectures.load_config picks the config "
                             f"class of a model_type)")
        values = cls.from_hf_names(values)
        for key in ("num_labels", "id2label", "label2id"):  # the label fields go in together, as transformers does
            if key in overrides:
                values[key] = overrides.pop(key)
        if "num_labels" in values and "id2label" in values and len(values["id2label"]) != values["num_labels"]:
            values.pop("id2label"), values.pop("label2id", None)  # num_labels asks for other labels: default names
        config = cls(**values)
        config.update_known(overrides, "BertConfig.from_dict", validate=False)
        return config

    @classmethod
    def from_hf_names(cls, values: dict[str, Any]) -> dict[str, Any]:
        """config.json's keys as this class names them (hf_names)."""
        return {cls.hf_names.get(k, k): v for k, v in values.items()}

    def to_hf_names(self, values: dict[str, Any]) -> dict[str, Any]:
        """The inverse of from_hf_names, for writing config.json."""
        ours = {v: k for k, v in self.hf_names.items()}
        return {ours.get(k, k): v for k, v in values.items()}

    # The models read their config on every forward, hundreds of times. transformers' PreTrainedConfig resolves each
    # read through two Python-level __getattribute__ overrides: its attribute_map (aliases; BertConfig has none) and
    # heterogeneous per-layer configs (which fastbert's are not), 3-6 us a read. object's own lookup is a C call with
    # no Python frame, and torch.compile reads such an object's fields as plain attributes. An architecture's config
    # that declares aliases gets transformers' lookup back (__init_subclass__).
    __getattribute__ = object.__getattribute__

    def __setattr__(self, name: str, value: Any) -> None:
        """The architecture's own spelling of a field (hf_names) sets that field, as transformers' attribute_map
        does: `--model.norm_eps` and replace(norm_eps=...) set ModernBERT's layer_norm_eps, never a stray attribute
        that config.json would then write and the model never read."""
        super().__setattr__(type(self).hf_names.get(name, name), value)

    def __getattr__(self, name: str):
        """Only reached for names the instance lacks: the architecture's own spelling of a field (hf_names)."""
        if name in type(self).hf_names:
            return getattr(self, type(self).hf_names[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "BertConfig":
        """Read an HF config.json (a file, or a directory holding one). Errors name the file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object of config fields, got {type(values).__name__}")
        try:
            return cls.from_dict(values, **overrides)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs: Any) -> "BertConfig":
        """config.json of a local directory or a hub id (through the HF cache, offline included);
        hub arguments (revision, cache_dir, token, local_files_only, subfolder) as transformers takes them,
        the other keyword arguments override fields."""
        from fastbert import hub

        hub_kwargs = {k: kwargs.pop(k) for k in hub.HUB_ARGUMENTS if k in kwargs}
        return cls.from_json(hub.resolve(name_or_path, **hub_kwargs), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """HF config.json's dict: the fields, the unknown keys kept from the source and the common
        transformers fields that differ from their defaults; fastbert's own switches left out. With
        `_name_or_path`, as transformers' to_dict (PEFT's model card reads the base model there), which
        config.json leaves out (config_json)."""
        values = {k: v for k, v in vars(self).items()
                  if not k.startswith("_") and k not in FASTBERT_FIELDS and k not in COMMON_CONFIG_DEFAULTS}
        for name, default in COMMON_CONFIG_DEFAULTS.items():
            value = getattr(self, name, default)
            if value != default:
                values[name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        for name in self.absent_fields:
            values.pop(name, None)
        values["model_type"] = self.model_type
        values = self.to_hf_names(values)
        values["id2label"] = {str(k): v for k, v in self.id2label.items()}
        values["label2id"] = {v: int(k) for k, v in self.id2label.items()}
        values["_name_or_path"] = self.name_or_path
        return values

    def config_json(self) -> dict[str, Any]:
        """config.json's dict: to_dict without `_name_or_path` (where the config was loaded from is not a field,
        and transformers leaves it out of config.json too)."""
        values = self.to_dict()
        del values["_name_or_path"]
        return values

    def to_json(self, path: str | os.PathLike) -> None:
        """Write HF config.json (a file path, or a directory to write config.json into)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        from fastbert.files import write_text  # replaced whole; a full disk is a message naming the file

        write_text(path, json.dumps(self.config_json(), indent=2, sort_keys=True) + "\n")

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """config.json into `save_directory` (created if needed), as transformers' method of that name."""
        if kwargs.get("push_to_hub"):
            raise ValueError("BertConfig.save_pretrained: push_to_hub is not supported; save, then upload")
        os.makedirs(save_directory, exist_ok=True)
        self.to_json(save_directory)


OWN_FIELDS = {name: getattr(BertConfig, name) for name in inspect.get_annotations(BertConfig)}
# BertConfig's annotations (strings: "int", "float | None", ...) -> what config.json may hold there, as
# transformers' strict configs take it (an integer where a float is expected, never a bool for a number)
_TYPE_CHECKS = {"int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
                "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
                "bool": (lambda v: isinstance(v, bool), "true or false"),
                "str": (lambda v: isinstance(v, str), "a string"),
                "None": (lambda v: v is None, "null")}


def check_field_types(config_class: type, values: dict[str, Any]) -> None:
    """ValueError naming the field (as config.json spells it), the type it must have and the value, for a field
    of BertConfig's given a value of another type (config.json's `"hidden_size": "384"`, `"num_attention_heads":
    null`), as transformers' strict config refuses it: before transformers' own validators, which would fail on
    it with a TypeError naming neither."""
    json_names = {ours: theirs for theirs, ours in config_class.hf_names.items()}
    for name, annotation in inspect.get_annotations(BertConfig).items():
        if name not in values:
            continue
        checks = [_TYPE_CHECKS[kind.strip()] for kind in annotation.split("|")]
        value = values[name]
        if not any(accepts(value) for accepts, _ in checks):
            expected = " or ".join(text for _, text in checks)
            shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
            raise ValueError(f"{config_class.__name__}.{json_names.get(name, name)} must be {expected}, got {shown}")
