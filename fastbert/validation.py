"""Input checks run before any kernel: each error names the argument, the bad value and the limit.

Shape and dtype checks read metadata and always run. Value checks (ids in range, mask values, labels, the
label budget, ...) run on the device without a host sync (`check_on_device`): on CPU a failed one raises
ValueError at once, naming the bad value; on CUDA it is an asynchronous device-side assert that fails the
next sync. `validate=False` skips the value checks (it is never needed for speed: they cost a few small
kernels), and they are skipped while torch.compile traces and under torch.func.vmap. Also here: the
transformers keyword arguments a forward accepts, and the conversion of transformers' 4-D attention masks to
fastbert's key padding mask.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# packed inputs (padding-free batches): fastbert's names, and transformers' flash-attention names for them
PACKED_ARGUMENTS = ("cu_seqlens", "max_seqlen")
HF_PACKED_ALIASES = {"cu_seq_lens_q": "cu_seqlens", "cu_seq_lens_k": "cu_seqlens", "max_length_q": "max_seqlen",
                     "max_length_k": "max_seqlen"}
# transformers' BERT forward arguments that do not change an encoder's result: accepted and ignored
IGNORED_HF_ARGUMENTS = ("use_cache", "cache_position", "num_items_in_batch", "output_router_logits")
# transformers' arguments for features fastbert does not implement (a decoder, cross-attention): accepted only
# when they ask for nothing. head_mask is not one: transformers 5's BERT no longer has it and ignores it in its
# **kwargs, as fastbert then does (logged once, below)
UNSET_HF_ARGUMENTS = ("encoder_hidden_states", "encoder_attention_mask", "seq_idx")
# other keyword names a forward was given (transformers' BERT takes **kwargs and ignores them; clients such as
# sentence-transformers rely on it): each logged once, so a typo is seen without breaking those clients
_REPORTED_UNKNOWN: set[str] = set()


# the CUDA kernel of torch._assert_async(cond, msg) holds messages of fewer characters than this
_DEVICE_MESSAGE_LIMIT = 255
_functorch_transforms = torch._C._are_functorch_transforms_active
_transforms = torch._C._functorch.get_interpreter_stack  # the torch.func transforms around the call, outermost first
_VMAP = torch._C._functorch.TransformType.Vmap


def check_on_device(ok: torch.Tensor, message: str, explain: Callable[[], str] | None = None) -> None:
    """Assert `ok` (a one-element bool tensor) without a host sync: torch._assert_async(ok, message).

    CPU tensors: a False `ok` raises ValueError at once, with explain() when given (the message with the
    offending value, read only on this error path) or `message`. CUDA tensors: nothing waits; a False `ok`
    is a device-side assert that fails the next host sync (RuntimeError "device-side assert triggered", with
    `message` printed by the kernel), after which the CUDA context is unusable, as after an out-of-range
    index in PyTorch's own kernels. Meta tensors (memory plans) have no values: nothing is checked. Nor under
    torch.func.vmap (per-sample gradients), whose batched values allow no assert, as while torch.compile traces.
    """
    if _functorch_transforms() and _VMAP in [level.key() for level in _transforms()]:
        return
    try:
        torch._assert_async(ok, message[:_DEVICE_MESSAGE_LIMIT - 1])
    except RuntimeError:
        if ok.device.type != "cpu":  # an earlier kernel's error surfacing at this launch: not this check's
            raise
        raise ValueError(message if explain is None else explain()) from None


def _check_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (token ids), got dtype {tensor.dtype}")


def _check_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """Ids that index an embedding table: int64 or int32, the dtypes torch's embedding lookup takes."""
    _check_integer(name, tensor)
    if tensor.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32 (embedding indices), got dtype {tensor.dtype}")


def _check_range(name: str, tensor: torch.Tensor, limit: int, limit_name: str, ignore: int | None = None) -> None:
    """Every value in [0, limit), except `ignore` where given: one min/max pass and one device assert (no
    host sync). Skipped while torch.compile traces."""
    if torch.compiler.is_compiling() or tensor.numel() == 0:
        return
    # ignored entries become 0, a valid value, so one min/max pass covers the rest
    values = tensor if ignore is None else tensor.masked_fill(tensor == ignore, 0)
    low, high = torch.aminmax(values)
    allowed = f"-100 or [0, {limit_name}={limit})" if ignore is not None else f"[0, {limit_name}={limit})"

    def explain() -> str:
        if low < 0:
            return f"{name} contains {int(low)}, outside {allowed}"
        return f"{name} contains {int(high)}, which is >= {limit_name} ({limit})"
    check_on_device((low >= 0) & (high < limit), f"{name} contains a value outside {allowed}", explain)


def check_model_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                       validate: bool, packed: bool = False, prefix_length: int = 0) -> tuple[int, int]:
    """Check BertModel's inputs; return (batch, seqlen). Packed inputs ([1, T], `packed`) may be longer
    than max_position_embeddings: their positions restart with each sequence; so may inputs with position_ids,
    which must each be below it, as transformers reads them. After prefix_length prefix keys (fastbert.prefix),
    the attention mask covers them too ([B, P + S]) and the positions start after them (not RoBERTa's from
    inputs_embeds, which transformers does not offset)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        _check_index_dtype("input_ids", input_ids)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_width:
            raise ValueError(f"inputs_embeds must be [batch, seq_len, {config.embedding_width}] (the embedding width), "
                             f"got shape {tuple(inputs_embeds.shape)}")
        shape = tuple(inputs_embeds.shape[:2])
    if shape[1] == 0:
        raise ValueError(f"sequences must hold at least one token, got input shape {shape}")
    # given position_ids are checked below
    first = prefix_length if input_ids is not None or not config.positions_from_padding else 0  # first position
    if (shape[1] + first > config.max_sequence_length and config.position_table and not packed
            and position_ids is None):
        offset = config.position_offset
        offset = f" less the {offset} positions before the first token" if offset else ""
        after = f" after {first} prefix keys" if first else ""
        raise ValueError(f"sequence length {shape[1]}{after} is longer than max_position_embeddings "
                         f"({config.max_position_embeddings}{offset})")
    for name, tensor in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                         ("position_ids", position_ids)):
        if tensor is None:
            continue
        expected = shape
        if name == "attention_mask":
            if validate and tensor.is_floating_point() and not torch.compiler.is_compiling():
                check_on_device(((tensor == 0) | (tensor == 1)).all(),
                                "attention_mask must hold 1 for tokens and 0 for padding; got other values")
            expected = (shape[0], prefix_length + shape[1])
        else:
            _check_index_dtype(name, tensor)
        if tuple(tensor.shape) != expected and not (name == "position_ids" and tuple(tensor.shape) == (1, shape[1])):
            keys = f" (the {prefix_length} prefix keys' columns first)" if expected != shape else ""
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}{keys}: input_ids has "
                             f"shape {shape}")
    if validate:
        if input_ids is not None:
            _check_range("input_ids", input_ids, config.vocab_size, "vocab_size")
        if token_type_ids is not None:
            _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")
        if position_ids is not None:
            _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")
    return shape


def check_labels(name: str, labels: torch.Tensor | None, shape: tuple[int, ...], limit: int, limit_name: str,
                 validate: bool) -> torch.Tensor | None:
    """Integer class labels, each in [0, limit) or -100 (ignored), returned in `shape`: labels of another shape with
    as many elements are read in order, as transformers' heads read labels.view(-1) (flattened [B*S] token labels,
    [B, 1] sentence labels)."""
    if labels is None:
        return None
    _check_integer(name, labels)
    if tuple(labels.shape) != tuple(shape):
        if labels.numel() != math.prod(shape):
            raise ValueError(f"{name} has shape {tuple(labels.shape)}, expected {tuple(shape)} (or as many elements)")
        labels = labels.reshape(shape)
    if validate:
        _check_range(name, labels, limit, limit_name, ignore=IGNORE_INDEX)
    return labels


def packed_arguments(kwargs: dict) -> dict:
    """The packed-input arguments among a forward's extra keyword arguments (transformers' flash-attention
    names mapped to fastbert's), after checking the rest: transformers' arguments that change nothing
    for an encoder are dropped, those asking for what fastbert does not implement raise, unknown names
    are ignored as transformers ignores them, logged once each (a typo must not go unseen)."""
    packed = {}
    unknown = []
    for name, value in kwargs.items():
        target = HF_PACKED_ALIASES.get(name, name)
        if target in PACKED_ARGUMENTS:
            if value is not None:  # self-attention: transformers' query and key lengths are the same
                packed.setdefault(target, value)
        elif name in UNSET_HF_ARGUMENTS:
            if value is not None:
                raise ValueError(f"{name} is not supported: fastbert implements BERT's encoder (no decoder or "
                                 f"cross-attention); pass None")
        elif name == "is_causal":
            if value:
                raise ValueError("is_causal=True is not supported: BERT's attention is bidirectional")
        elif name not in IGNORED_HF_ARGUMENTS and name not in _REPORTED_UNKNOWN:
            unknown.append(name)
    if unknown and not torch.compiler.is_compiling():  # a traced graph cannot log (fullgraph=True failed on it)
        _REPORTED_UNKNOWN.update(unknown)
        logger.warning("forward() ignored keyword argument(s) %s, as transformers' BERT does (they change "
                       "nothing; a misspelt argument name would be among them)", unknown)
    return packed


def key_padding_mask(attention_mask: torch.Tensor | None, validate: bool) -> torch.Tensor | None:
    """transformers' attention masks as fastbert's key padding mask [B, S] (1 = token, 0 = padding).

    A 2-D mask passes through. A 4-D mask [B, 1, 1, S] or [B, 1, S, S] is boolean (True = attend) or
    additive (0 = attend, a large negative value = masked), as transformers builds them; fastbert's
    attention masks keys only, so every query row must mask the same keys (checked when `validate`).
    """
    if attention_mask is None or attention_mask.dim() != 4:
        return attention_mask
    if attention_mask.shape[1] != 1:
        raise ValueError(f"a 4-D attention_mask must be [batch, 1, 1 or seq_len, seq_len], got shape "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        if validate and not torch.compiler.is_compiling():
            soft = (attention_mask != 0) & (attention_mask > -1e4)
            check_on_device(~soft.any(), "a 4-D float attention_mask must be additive: 0 to attend and a large "
                            "negative value (<= -1e4, e.g. torch.finfo(dtype).min) to mask; got other values")
        keep = attention_mask == 0
    keep = keep[:, 0]  # [B, 1 or S, S]
    if validate and keep.shape[1] > 1 and not torch.compiler.is_compiling():
        check_on_device((keep == keep[:, :1]).all(),
                        "a 4-D attention_mask whose query rows mask different keys (e.g. block-diagonal packing) is "
                        "not supported: fastbert masks padding keys only; pass packed inputs with cu_seqlens and "
                        "max_seqlen instead")
    return keep[:, 0]


def check_packed_inputs(config, input_ids, attention_mask, inputs_embeds, cu_seqlens, max_seqlen,
                        output_attentions: bool, validate: bool) -> None:
    """Packed inputs: the tokens of B sequences one after another, input_ids [1, T] (or inputs_embeds
    [1, T, H]), cu_seqlens int32 [B+1] (0, ..., T) and max_seqlen an int >= the longest sequence."""
    source = input_ids if input_ids is not None else inputs_embeds
    if source is None or source.shape[0] != 1:
        raise ValueError("packed inputs (cu_seqlens) need input_ids [1, total_tokens] (or inputs_embeds "
                         f"[1, total_tokens, hidden]), got {None if source is None else tuple(source.shape)}")
    if attention_mask is not None:
        raise ValueError("packed inputs (cu_seqlens) have no padding: pass attention_mask=None")
    if output_attentions:
        raise ValueError("output_attentions needs padded inputs; packed inputs (cu_seqlens) do not return them")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 [batch + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen > config.max_position_embeddings:
        raise ValueError(f"max_seqlen must be an int <= max_position_embeddings ({config.max_position_embeddings}),"
                         f" got {max_seqlen!r}")
    if validate and not torch.compiler.is_compiling():
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        rises = f"cu_seqlens must rise from 0 to the number of tokens ({source.shape[1]}) in steps >= 1"
        check_on_device((cu_seqlens[0] == 0) & (cu_seqlens[-1] == source.shape[1]) & (lengths.min() >= 1), rises,
                        lambda: f"{rises}, got {cu_seqlens.tolist()}")
        shorter = f"max_seqlen ({max_seqlen}) is shorter than the longest sequence"
        check_on_device(lengths.max() <= max_seqlen, shorter, lambda: f"{shorter} ({int(lengths.max())})")


def check_label_budget(labels: torch.Tensor | None, budget: int, validate: bool) -> None:
    """With max_predictions_per_seq = K > 0 the MLM loss reads K positions per sequence: a sequence with
    more labels would silently lose some, so it is an error (checked when `validate`)."""
    if labels is None or budget == 0 or not validate or torch.compiler.is_compiling() or not labels.numel():
        return
    most = (labels != IGNORE_INDEX).sum(dim=-1).max()
    check_on_device(most <= budget, f"labels has a sequence with more labelled tokens than max_predictions_per_seq "
                    f"({budget}); raise it or label fewer tokens",
                    lambda: f"labels has a sequence with {int(most)} labelled tokens, more than "
                            f"max_predictions_per_seq ({budget}); raise it or label fewer tokens")
