"""Input checks run before any kernel: each error names the argument, the bad value and the limit.

Shape and dtype checks cost nothing and always run. Value checks (ids in range) read the tensor's
min and max, a device sync on GPU; `validate=False` skips those for training loops that trust their data.
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _check_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (token ids), got dtype {tensor.dtype}")


def _check_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """Ids that index an embedding table: int64 or int32, the dtypes torch's embedding lookup takes."""
    _check_integer(name, tensor)
    if tensor.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32 (embedding indices), got dtype {tensor.dtype}")


def _check_range(name: str, tensor: torch.Tensor, limit: int, limit_name: str, ignore: int | None = None) -> None:
    """Every value in [0, limit), except `ignore` where given. Skipped while torch.compile traces:
    reading values back to the host would break the graph."""
    if torch.compiler.is_compiling() or tensor.numel() == 0:
        return
    # ignored entries become 0, a valid value, so one min/max pass (one host sync) covers the rest
    values = tensor if ignore is None else tensor.masked_fill(tensor == ignore, 0)
    low, high = torch.stack(torch.aminmax(values)).tolist()
    if low < 0:
        allowed = f"-100 or [0, {limit_name}={limit})" if ignore is not None else f"[0, {limit_name}={limit})"
        raise ValueError(f"{name} contains {low}, outside {allowed}")
    if high >= limit:
        raise ValueError(f"{name} contains {high}, which is >= {limit_name} ({limit})")


def check_model_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                       validate: bool) -> tuple[int, int]:
    """Check BertModel's inputs; return (batch, seqlen)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        _check_index_dtype("input_ids", input_ids)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(f"inputs_embeds must be [batch, seq_len, hidden_size={config.hidden_size}], "
                             f"got shape {tuple(inputs_embeds.shape)}")
        shape = tuple(inputs_embeds.shape[:2])
    if shape[1] == 0:
        raise ValueError(f"sequences must hold at least one token, got input shape {shape}")
    if shape[1] > config.max_position_embeddings:
        raise ValueError(f"sequence length {shape[1]} is longer than max_position_embeddings "
                         f"({config.max_position_embeddings})")
    for name, tensor in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                         ("position_ids", position_ids)):
        if tensor is None:
            continue
        if name == "attention_mask":
            if validate and tensor.is_floating_point() and not torch.compiler.is_compiling():
                if not bool(((tensor == 0) | (tensor == 1)).all()):
                    raise ValueError("attention_mask must hold 1 for tokens and 0 for padding; got other values")
        else:
            _check_index_dtype(name, tensor)
        if tuple(tensor.shape) != shape and not (name == "position_ids" and tuple(tensor.shape) == (1, shape[1])):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, but input_ids has shape {shape}")
    if validate:
        if input_ids is not None:
            _check_range("input_ids", input_ids, config.vocab_size, "vocab_size")
        if token_type_ids is not None:
            _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")
        if position_ids is not None:
            _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")
    return shape


def check_labels(name: str, labels: torch.Tensor | None, shape: tuple[int, ...], limit: int, limit_name: str,
                 validate: bool) -> None:
    """Integer class labels of the given shape, each in [0, limit) or -100 (ignored)."""
    if labels is None:
        return
    _check_integer(name, labels)
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(labels.shape)}, expected {tuple(shape)}")
    if validate:
        _check_range(name, labels, limit, limit_name, ignore=IGNORE_INDEX)
