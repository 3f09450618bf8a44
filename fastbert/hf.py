"""HF checkpoint interop: read and write HF BERT directories, convert to and from transformers objects.

An HF directory is config.json + model.safetensors (or pytorch_model.bin, or sharded with an
index.json). Keys are normalised on load: legacy LayerNorm gamma/beta -> weight/bias, stray
position_ids / token_type_ids buffers dropped, the decoder's tied copies folded, and the `bert.`
prefix added or removed so that a BertModel loads from a BertForPreTraining checkpoint and back.
transformers itself is needed only by `from_hf` / `to_hf`.
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from fastbert.config import BertConfig
from fastbert.files import file_mode

SAFETENSORS_NAME = "model.safetensors"
TORCH_NAME = "pytorch_model.bin"
BASE_PREFIX = "bert."
# Tied to bert.embeddings.word_embeddings.weight (and cls.predictions.bias): never stored twice.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
BUFFER_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (single file or sharded), on CPU."""
    from safetensors.torch import load_file

    for name, loader in ((SAFETENSORS_NAME, load_file),
                         (TORCH_NAME, lambda f: torch.load(f, map_location="cpu", weights_only=True))):
        file = os.path.join(path, name)
        if os.path.exists(file):
            return loader(file)
        index = f"{file}.index.json"
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(loader(os.path.join(path, shard)))
            return state
    raise FileNotFoundError(f"no {SAFETENSORS_NAME} or {TORCH_NAME} (or a sharded index of either) in {path}")


def normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-format keys, whatever the checkpoint's vintage (see the module docstring)."""
    out = {}
    for key, value in state.items():
        if key.endswith(BUFFER_SUFFIXES):
            continue
        if key.endswith(".gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith(".beta"):
            key = key[: -len("beta")] + "bias"
        out[key] = value
    if "cls.predictions.decoder.bias" in out:
        bias = out.pop("cls.predictions.decoder.bias")
        out.setdefault("cls.predictions.bias", bias)
    out.pop("cls.predictions.decoder.weight", None)  # tied to the word embeddings
    return out


BASE_MODULES = ("embeddings.", "encoder.", "pooler.")  # BertModel's children: what `bert.` prefixes


def match_prefix(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Add or strip `bert.` so the checkpoint's keys line up with the model's (heads hold a `bert`)."""
    model_has_prefix = hasattr(model, "bert")
    state_has_prefix = any(k.startswith(BASE_PREFIX) for k in state)
    if model_has_prefix and not state_has_prefix:
        return {(BASE_PREFIX + k if k.startswith(BASE_MODULES) else k): v for k, v in state.items()}
    if state_has_prefix and not model_has_prefix:
        return {k.removeprefix(BASE_PREFIX): v for k, v in state.items()}
    return state


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Load HF-format tensors into a fastbert model; return (and warn about) missing / unexpected keys."""
    state = match_prefix(normalize_keys(state), model)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in TIED_KEYS]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        warnings.warn(f"{type(model).__name__}: missing keys (newly initialised) {missing}; "
                      f"unexpected keys (ignored) {unexpected}", stacklevel=3)
    return {"missing_keys": missing, "unexpected_keys": unexpected}


def load_pretrained(cls, path, output_loading_info=False, **config_overrides):
    """`Model.from_pretrained`: config.json (with overrides) + weights from an HF directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_pretrained expects a local HF checkpoint directory, got {path!r}")
    config = BertConfig.from_json(path, **config_overrides)
    model = cls(config)
    state = read_state_dict(path)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    info = load_state(model, state)
    if len(dtypes) == 1:  # keep the checkpoint's precision, as transformers does with dtype="auto"
        model.to(dtypes.pop())
    model.eval()  # as transformers: a loaded model starts in eval mode (dropout off)
    return (model, info) if output_loading_info else model


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under HF's names, tied copies left out, contiguous and on CPU."""
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k not in TIED_KEYS}


def save_pretrained(model: torch.nn.Module, path) -> None:
    """config.json + model.safetensors, loadable by transformers' from_pretrained unchanged.

    Files are written to temporary names and renamed, so an interrupted save never leaves a
    half-written checkpoint under the final names.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    values = model.config.to_dict()
    values["architectures"] = [type(model).__name__]
    values["tie_word_embeddings"] = True
    values["dtype"] = str(model.dtype).removeprefix("torch.")
    config_tmp = os.path.join(path, "config.json.tmp")
    with open(config_tmp, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    weights_tmp = os.path.join(path, SAFETENSORS_NAME + ".tmp")
    try:
        save_file(hf_state_dict(model), weights_tmp, metadata={"format": "pt"})
    except SafetensorError as exc:  # a failed write (a full disk) comes as safetensors' own error type
        raise OSError(f"{exc} (writing {weights_tmp})") from exc
    os.chmod(weights_tmp, file_mode())  # safetensors creates its file 0600; give it the umask's mode as config.json
    os.replace(weights_tmp, os.path.join(path, SAFETENSORS_NAME))
    os.replace(config_tmp, os.path.join(path, "config.json"))


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("from_hf / to_hf need transformers: pip install 'fastbert[hf]'") from exc
    return transformers


def from_hf(hf_model, **config_overrides):
    """A fastbert model of the same class with identical weights, from an in-memory transformers BERT."""
    from fastbert.modeling import MODEL_CLASSES

    name = type(hf_model).__name__
    if name not in MODEL_CLASSES:
        raise ValueError(f"from_hf supports {sorted(MODEL_CLASSES)}, got {name}")
    config = BertConfig.from_dict(hf_model.config.to_dict(), **config_overrides)
    model = MODEL_CLASSES[name](config)
    reference = next(hf_model.parameters())
    model.to(device=reference.device, dtype=reference.dtype)
    load_state(model, hf_model.state_dict())
    model.train(hf_model.training)
    return model


def to_hf(model):
    """The same model as a transformers object with identical weights (class chosen by name)."""
    transformers = _require_transformers()
    hf_class = getattr(transformers, type(model).__name__)
    hf_config = transformers.BertConfig(**model.config.to_dict())
    hf_model = hf_class(hf_config)
    result = hf_model.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in result.missing_keys if k not in TIED_KEYS]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"to_hf: missing {missing}, unexpected {result.unexpected_keys}")
    if hasattr(hf_model, "tie_weights"):
        hf_model.tie_weights()
    reference = next(model.parameters())
    hf_model.to(device=reference.device, dtype=reference.dtype)
    return hf_model.train(model.training)
