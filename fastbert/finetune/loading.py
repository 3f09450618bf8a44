"""What `fastbert finetune`, `embed` and `convert` are pointed at: the checkpoint directory (or hub id), its
weights and the device, each checked so that a wrong one is a message naming the argument, never a traceback."""
from __future__ import annotations

import json
import os
import pickle

import torch

ACCEPTED = ("it takes a BERT checkpoint directory (config.json with model.safetensors or pytorch_model.bin, "
            "sharded or not, as transformers' save_pretrained, `fastbert finetune` and `fastbert pretrain` "
            "(runs/NAME/checkpoints/step_N/model) write it) or a hub id")


def checkpoint_directory(path: str, flag: str = "--model") -> str:
    """The local checkpoint directory `path` names: `path` itself, or a hub id resolved through the HF cache
    (config, weights and tokenizer files). ValueError saying what is accepted when it is neither, or when
    the directory has no readable config.json."""
    from fastbert import hub

    if os.path.isfile(path):
        raise ValueError(f"{flag} {path} is a file; {ACCEPTED}")
    if not os.path.isdir(path):
        try:
            path = hub.resolve(path, tokenizer=True)
        except FileNotFoundError as exc:  # its message says what is accepted
            raise ValueError(f"{flag} {exc}") from None
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"{flag} {path} has no config.json; {ACCEPTED}")
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config}: not a JSON config ({exc}); the checkpoint is damaged") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config}: expected a JSON object, got {type(values).__name__}")
    return path


def load_checkpoint(cls, path: str, flag: str = "--model", **overrides):
    """(model, loading info) of `cls` from the checkpoint directory `path`. Unreadable weights (truncated
    or not safetensors, a damaged .bin or index, tensors whose shapes disagree with config.json) are a
    ValueError naming the directory; missing and unexpected keys are logged (fastbert.hf) and returned."""
    from safetensors import SafetensorError

    path = checkpoint_directory(path, flag)
    try:
        return cls.from_pretrained(path, output_loading_info=True, **overrides)
    except (SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError, KeyError) as exc:
        raise ValueError(f"{flag} {path}: the weights cannot be loaded ({type(exc).__name__}: "
                         f"{str(exc).strip()[:500]}); the files are damaged or do not match config.json") from None


def resolve_device(name: str | None) -> torch.device:
    """--device as a torch.device (default: cuda when available, else cpu); one this machine lacks is a ValueError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    return device
