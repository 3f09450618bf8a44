"""Prefix keys: transformers' cache as an encoder reads it.

PEFT's prefix tuning (P-Tuning v2) learns P keys and values for every layer and hands them to transformers'
BERT, RoBERTa and ELECTRA as the model's cache (`cache=`, or its older name `past_key_values=`, which
transformers still accepts): every layer attends to its P prefix keys before the tokens' own, the attention mask
covers both ([B, P + S]: PEFT prepends ones), and the tokens' positions start after the prefix. fastbert reads
the prefix from the cache and leaves the cache as it was, where transformers' layers append the batch's keys to
it: an encoder never reads them back (a cache passed to a second forward holds the prefix alone here, prefix and
the first batch in transformers). The architectures whose transformers model has no cache (DistilBERT, MPNet,
ModernBERT) ignore one, as transformers does.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
_REPORTED_IGNORED = set()  # the model classes whose ignored cache was logged (once each)


def cache_argument(cache, kwargs: dict):
    """The forward's cache: `cache`, or transformers' older name past_key_values (taken out of kwargs)."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None and cache is not None:
        raise ValueError("pass the prefix keys as cache or as past_key_values, not both")
    return cache if legacy is None else legacy


def prefix_keys(model, cache) -> tuple[tuple | None, int]:
    """(each layer's (key, value) [B, heads, P, d], P) from a transformers Cache (DynamicCache, the
    self-attention part of an EncoderDecoderCache) or a sequence of (key, value) pairs, one per layer;
    (None, 0) for no cache or an empty one, and for an architecture whose transformers model ignores a cache
    (DistilBERT, MPNet, ModernBERT: ignored here too, logged once). ValueError for keys whose shapes do not fit
    the config, or for a cache of another number of layers."""
    if cache is None:
        return None, 0
    if not model.takes_cache:
        name = type(model).__name__
        if name not in _REPORTED_IGNORED and not torch.compiler.is_compiling():  # a traced graph cannot log
            _REPORTED_IGNORED.add(name)
            logger.warning("%s.forward() ignored its cache (past_key_values), as transformers' model of this "
                           "architecture does: it has no prefix keys (PEFT's prefix tuning cannot run on it)", name)
        return None, 0
    cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache: its self-attention part
    layers = getattr(cache, "layers", None)
    if layers is None and not isinstance(cache, (list, tuple)):
        raise ValueError(f"cache must be a transformers Cache or a sequence of (key, value) pairs, one per layer, "
                         f"got {type(cache).__name__}")
    pairs = ([(layer.keys, layer.values) for layer in layers] if layers is not None
             else [tuple(pair) for pair in cache])
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("cache must hold one (key, value) pair per layer")
    if all(key is None or key.numel() == 0 for key, _ in pairs):
        return None, 0  # nothing cached: transformers' forward is the one without a cache
    config = model.config
    if len(pairs) != config.num_hidden_layers:
        raise ValueError(f"cache holds {len(pairs)} layers' keys, the model has {config.num_hidden_layers} layers")
    first = pairs[0][0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"cache layer 0 holds no keys (got {type(first).__name__}): every layer needs its prefix")
    length = first.shape[2] if first.dim() == 4 else -1
    expected = (first.shape[0], config.num_attention_heads, length, config.head_dim)
    for index, pair in enumerate(pairs):
        for name, tensor in zip(("keys", "values"), pair):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"cache layer {index}'s {name} must be a tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != expected or length < 1:
                raise ValueError(f"cache layer {index}'s {name} has shape {tuple(tensor.shape)}: every layer's keys and "
                                 f"values must be [batch, {config.num_attention_heads} heads, prefix length >= 1, "
                                 f"{config.head_dim}], all alike (layer 0's keys: {tuple(first.shape)})")
            if not tensor.is_floating_point() or tensor.device != first.device:
                raise ValueError(f"cache layer {index}'s {name} is {tensor.dtype} on {tensor.device}: prefix keys must "
                                 f"be floating point, all on one device (layer 0's keys: {first.device})")
    return tuple(pairs), length


def check_batch(prefixes, batch: int, device: torch.device) -> None:
    """ValueError unless the prefix keys are the batch's: one prefix per sequence, as transformers concatenates,
    on the inputs' device."""
    keys = prefixes[0][0]
    if keys.shape[0] != batch:
        raise ValueError(f"cache holds prefix keys for a batch of {keys.shape[0]}, the inputs have {batch} sequences")
    if keys.device != device:
        raise ValueError(f"cache's prefix keys are on {keys.device}, the inputs on {device}")
