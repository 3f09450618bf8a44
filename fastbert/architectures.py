"""Every architecture fastbert builds, by model_type and by transformers' class name: its config class and
model classes, registered in transformers' Auto classes (fastbert.auto) where it is installed. Above the
models in the import order: nothing below imports it.

    config = fastbert.architectures.load_config("path/to/checkpoint")      # the class its model_type names
    model = fastbert.architectures.model_class(config, "ForMaskedLM").from_pretrained("path/to/checkpoint")
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from fastbert import auto, family, hub, modeling, modernbert
from fastbert.bases import HAVE_TRANSFORMERS
from fastbert.config import BertConfig
from fastbert.family_config import FAMILY_CONFIGS
from fastbert.hf import choose_layer_norm_backward, load_state, pooler_argument

CONFIG_CLASSES = {cls.model_type: cls for cls in FAMILY_CONFIGS}
MODEL_CLASSES = {**modeling.MODEL_CLASSES, **family.FAMILY_CLASSES, **modernbert.MODERNBERT_CLASSES}
if HAVE_TRANSFORMERS:
    auto.register(FAMILY_CONFIGS, MODEL_CLASSES)


def config_class(model_type: str) -> type[BertConfig]:
    """ValueError naming the model_type and the ones fastbert builds where it builds none."""
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not an architecture fastbert builds; it builds "
                         f"{', '.join(sorted(CONFIG_CLASSES))}")
    return CONFIG_CLASSES[model_type]


def config_from_dict(values: dict[str, Any], **overrides: Any) -> BertConfig:
    """The config of config.json's dict, of the class its model_type (default "bert") names."""
    return config_class(values.get("model_type", BertConfig.model_type)).from_dict(values, **overrides)


def load_config(name_or_path: str | os.PathLike, **overrides: Any) -> BertConfig:
    """config.json (a file, a directory or a hub id) as the config class of its model_type."""
    path = os.fspath(name_or_path)
    if not os.path.isfile(path):
        path = os.path.join(hub.resolve(path), "config.json")
    with open(path, encoding="utf-8") as f:
        values = json.load(f)
    return config_class(values.get("model_type", BertConfig.model_type)).from_json(path, **overrides)


def model_class(config: BertConfig, head: str) -> type:
    """fastbert's class for `config`'s architecture and `head` ("Model", "ForMaskedLM", "ForPreTraining",
    "ForSequenceClassification", ...): ValueError naming what exists where fastbert has no such class."""
    prefix = type(config).__name__.removesuffix("Config")
    name = prefix + head
    if name not in MODEL_CLASSES:
        available = sorted(n.removeprefix(prefix) for n in MODEL_CLASSES if n.startswith(prefix)
                           and MODEL_CLASSES[n].config_class is type(config))
        raise ValueError(f"fastbert has no {name}; for {config.architecture} it has {', '.join(available)} "
                         f"(transformers' other heads run on fastbert's kernels through fastbert.apply)")
    return MODEL_CLASSES[name]


def from_hf(hf_model, **config_overrides):
    """A fastbert model of the same class with a copy of the weights, from an in-memory transformers model
    (`fastbert.apply` accelerates one in place instead, sharing its weights)."""
    name = type(hf_model).__name__
    if name not in MODEL_CLASSES:
        raise ValueError(f"from_hf supports {sorted(MODEL_CLASSES)}, got {name}")
    config = config_from_dict(hf_model.config.to_dict(), **config_overrides)
    model_class = MODEL_CLASSES[name]
    with torch.device("meta"):
        model = model_class(config, **pooler_argument(model_class, hf_model))
    reference = next(hf_model.parameters())
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    load_state(model, state, f"{name} (transformers)", reference.dtype, reference.device)
    if "layer_norm_backward" not in config_overrides:
        choose_layer_norm_backward(model, config)
    return model.train(hf_model.training)
