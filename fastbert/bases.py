"""The base classes of fastbert's config, models and outputs.

Where transformers (5.x) imports, they are its own `PreTrainedConfig`, `PreTrainedModel` and `ModelOutput`,
so fastbert's objects are what its ecosystem checks for and calls: Trainer, pipelines, PEFT and
sentence-transformers take them unchanged. Without transformers, the stand-ins below give the same
behaviour for everything fastbert itself uses, so fastbert imports and runs without it.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import torch
from torch import nn
from torch.utils import _pytree
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger("fastbert")

# Attributes every transformers config carries, with their defaults (written to config.json when changed).
COMMON_CONFIG_DEFAULTS = {"architectures": None, "output_hidden_states": False, "output_attentions": False,
                          "return_dict": True, "dtype": None, "chunk_size_feed_forward": 0,
                          "is_encoder_decoder": False, "problem_type": None, "transformers_version": None}


def _transformers_bases():
    """transformers' three base classes, or None where it does not import or is older than 5."""
    try:
        import transformers
        from transformers import PreTrainedConfig, PreTrainedModel
        from transformers.utils import ModelOutput
    except ImportError:
        return None
    if int(transformers.__version__.split(".")[0]) < 5:
        logger.warning("transformers %s is older than 5: fastbert's models are not transformers objects "
                       "(pip install 'transformers>=5')", transformers.__version__)
        return None
    return PreTrainedConfig, PreTrainedModel, ModelOutput


def _dtype(value):
    """config.json's dtype (a string such as "float32") as a torch.dtype; None stays None."""
    return getattr(torch, value) if isinstance(value, str) else value


class StandInConfig:
    """What fastbert uses of transformers' PreTrainedConfig: the fine-tuning and output fields, num_labels
    kept in step with id2label, unknown keys kept as attributes."""

    model_type = ""

    def __init__(self, *, id2label=None, label2id=None, num_labels=None, name_or_path="", torch_dtype=None,
                 **kwargs):
        for name, default in COMMON_CONFIG_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.dtype = _dtype(self.dtype if self.dtype is not None else torch_dtype)
        self.id2label = None if id2label is None else {int(k): v for k, v in id2label.items()}
        self.label2id = label2id
        if self.id2label is None:
            self.num_labels = 2 if num_labels is None else num_labels
        self._name_or_path = str(name_or_path)
        for key, value in kwargs.items():
            setattr(self, key, value)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, value: int) -> None:
        if self.id2label is None or len(self.id2label) != value:
            self.id2label = {i: f"LABEL_{i}" for i in range(value)}
            self.label2id = {label: i for i, label in self.id2label.items()}

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @name_or_path.setter
    def name_or_path(self, value) -> None:
        self._name_or_path = str(value)

    @property
    def use_return_dict(self) -> bool:
        return self.return_dict

    def get_text_config(self, decoder=None, encoder=None):
        return self


class StandInModel(nn.Module):
    """What fastbert uses of transformers' PreTrainedModel: weight init once per module (skipped while
    building on the meta device), weight tying from `_tied_weights_keys`, gradient checkpointing,
    device / dtype / num_parameters."""

    config_class = None
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _tied_weights_keys: dict[str, str] | None = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.name_or_path = config.name_or_path

    def post_init(self) -> None:
        if torch.get_default_device().type != "meta":  # weights about to be loaded: no init
            with torch.no_grad():
                for module in self.modules():
                    if not getattr(module, "_is_hf_initialized", False):
                        self._init_weights(module)
                        module._is_hf_initialized = True
        self.tie_weights()

    def tie_weights(self, **kwargs) -> None:
        if not getattr(self.config, "tie_word_embeddings", True):
            return
        for target, source in (self._tied_weights_keys or {}).items():
            parent, name = target.rsplit(".", 1)
            setattr(self.get_submodule(parent), name, self.get_parameter(source))

    @property
    def base_model(self) -> nn.Module:
        return getattr(self, self.base_model_prefix, self)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        self._set_gradient_checkpointing(True, functools.partial(checkpoint, **kwargs))

    def gradient_checkpointing_disable(self) -> None:
        self._set_gradient_checkpointing(False, None)

    def _set_gradient_checkpointing(self, enable: bool, function, every_n_layers: int = 1) -> None:
        """transformers' signature; without transformers nothing passes every_n_layers (stand-ins have no
        activation_checkpointing_enable), and fastbert's models read it in their override."""
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = enable
                module._gradient_checkpointing_func = function

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.modules())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and not (exclude_embeddings and id(p) in embeddings))


class StandInOutput(collections.OrderedDict):
    """transformers' ModelOutput behaviour: a dataclass whose non-None fields are also dict items
    (`out.logits`, `out["logits"]`, `"logits" in out`, iteration over keys, item assignment), indexed
    like a tuple of those fields (`out[0]`), and registered with torch's pytree so torch.export and
    DDP see through it."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        _pytree.register_pytree_node(cls, lambda out: (list(out.values()), list(out.keys())),
                                     lambda values, keys: cls(**dict(zip(keys, values))),
                                     serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                super().__setitem__(field.name, value)

    def __getitem__(self, key):
        return super().__getitem__(key) if isinstance(key, str) else self.to_tuple()[key]

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name, value) -> None:
        if value is not None and name in {f.name for f in dataclasses.fields(self)}:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __reduce__(self):
        callable_, _, *rest = super().__reduce__()
        return callable_, tuple(getattr(self, f.name) for f in dataclasses.fields(self)), *rest

    def to_tuple(self) -> tuple:
        return tuple(self.values())


TRANSFORMERS_BASES = _transformers_bases()
HAVE_TRANSFORMERS = TRANSFORMERS_BASES is not None
ConfigBase, ModelBase, OutputBase = TRANSFORMERS_BASES or (StandInConfig, StandInModel, StandInOutput)
