"""Inference with CUDA graphs: `CapturedForward` runs a model's forward as one replayed CUDA graph per
(batch size, length bucket), so the host launches one graph instead of every kernel of the forward.

A batch of B sequences of length S is padded up to the smallest captured batch size >= B and the
smallest length bucket >= S (padding tokens with attention mask 0; extra rows fully padded), the graph of
that shape is replayed (captured on first use, after warm-up runs that autotune the kernels outside the
graph), and the outputs are cut back to the B real rows and the S real positions. A fastbert forward can
be captured because it never syncs with the host and takes every size from the shapes (its input checks
run on the device and are replayed with the graph).

Limits: the shapes are static (a batch larger than the largest batch size or longer than the largest
bucket is an error); the model must be in eval mode (a captured dropout mask would be replayed on every
call); each graph keeps its own memory pool, the activations and outputs of one forward at its shape,
for as long as the helper lives (the memory grows with the number of shapes captured); the forward's
keyword arguments (output_hidden_states, ...) and the autocast state are fixed per graph (another
autocast state captures another graph). Outputs are copies of the graph's static outputs. Without CUDA
(CPU tensors) the same padding and bucketing run the model eagerly, with the same results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
WARMUP_RUNS = 2  # eager runs before a capture: Triton autotuning and lazy initialisation stay out of the graph
# two (batch, length) shapes whose sizes tell the batch dims (1 -> 2) and the length dims (2 -> 3) of an output
_PROBE_SHAPES = ((1, 2), (2, 3))
_BATCH_CHANGE, _LENGTH_CHANGE = tuple(zip(*_PROBE_SHAPES))


def length_buckets(longest: int, shortest: int = 16) -> tuple[int, ...]:
    """Powers of two from `shortest` up to below `longest`, then `longest`: (16, 32, 64, 128) for 128, (16, 32,
    64, 100) for 100; (longest,) when longest <= shortest."""
    buckets = []
    size = shortest
    while size < longest:
        buckets.append(size)
        size *= 2
    return (*buckets, longest)


@dataclass
class _Graph:
    inputs: dict  # name -> static input [batch, length], refilled before each replay
    graph: torch.cuda.CUDAGraph
    outputs: object  # the forward's output, whose tensors each replay rewrites


class CapturedForward:
    """model(input_ids, attention_mask, token_type_ids, **forward_kwargs) through CUDA graphs, one per (batch size,
    length bucket); see the module docstring for how and its limits.

    model: any fastbert model, or a transformers model after fastbert.apply, in eval mode, whose outputs
    are per sequence ([B, ...]) or per token ([B, S, ...], [B, heads, S, S]). batch_sizes and length_buckets:
    the padded shapes (positive ints; length_buckets at most the model's positions). forward_kwargs: fixed
    keyword arguments of every call (e.g. output_hidden_states=True).

    Calling it returns what model(...) returns for the given inputs (the same output class and fields, the
    real rows and positions only). Raises ValueError for a model in training mode, a batch or a length
    past the largest size, or bad sizes.
    """

    def __init__(self, model: torch.nn.Module, batch_sizes=(1, 8, 32), length_buckets=(32, 64, 128, 256, 512),
                 **forward_kwargs):
        for name, sizes in (("batch_sizes", batch_sizes), ("length_buckets", length_buckets)):
            if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
                raise ValueError(f"{name} must be positive ints, got {sizes!r}")
        config = getattr(model, "config", None)
        positions = getattr(config, "max_sequence_length", None)
        if positions is not None and max(length_buckets) > positions:
            raise ValueError(f"length_buckets holds {max(length_buckets)}, more than the {positions} tokens the "
                             f"model's positions hold")
        self.model = model
        self.batch_sizes, self.length_buckets = tuple(sorted(set(batch_sizes))), tuple(sorted(set(length_buckets)))
        self.forward_kwargs = forward_kwargs
        self.pad_token_id = getattr(config, "pad_token_id", None) or 0
        self.graphs: dict[tuple, _Graph] = {}
        self._output_dims: dict[tuple, list] = {}  # input names -> per output tensor: (batch dims, length dims)

    def padded_shape(self, batch: int, length: int) -> tuple[int, int]:
        """The captured shape a batch of `batch` sequences of `length` tokens runs at."""
        for name, value, sizes in (("batch size", batch, self.batch_sizes), ("length", length, self.length_buckets)):
            if value > sizes[-1]:
                raise ValueError(f"{name} {value} is larger than the largest captured one ({sizes[-1]}); "
                                 f"give CapturedForward larger {'batch_sizes' if name == 'batch size' else 'length_buckets'}")
        return (next(s for s in self.batch_sizes if s >= batch), next(s for s in self.length_buckets if s >= length))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None):
        """input_ids int [B, S]; attention_mask [B, S] (1 = token, 0 = padding; default all tokens);
        token_type_ids int [B, S] or None. Returns the model's output for these B sequences."""
        if self.model.training:
            raise ValueError("CapturedForward needs the model in eval mode (model.eval()): a captured dropout mask "
                             "would be replayed on every call")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        for name, tensor in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            # copied into the corner of a padded buffer, another shape would broadcast or be cut, not be refused
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected input_ids' "
                                 f"{tuple(input_ids.shape)}")
        given = {"input_ids": input_ids, "attention_mask": attention_mask if attention_mask is not None
                 else torch.ones_like(input_ids), "token_type_ids": token_type_ids}
        given = {name: tensor for name, tensor in given.items() if tensor is not None}
        shape = self.padded_shape(batch, length)
        if input_ids.is_cuda:
            graph = self._graph(shape, given)
            _fill(graph.inputs, given, self.pad_token_id)
            graph.graph.replay()
            outputs, copy = graph.outputs, True
        else:  # no CUDA graphs: the same padded shapes, run eagerly
            inputs = {name: tensor.new_empty(shape) for name, tensor in given.items()}
            _fill(inputs, given, self.pad_token_id)
            outputs, copy = self.model(**inputs, **self.forward_kwargs), False
        return self._real_part(outputs, tuple(given), batch, length, copy)

    def _graph(self, shape: tuple[int, int], given: dict) -> _Graph:
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        key = (shape, tuple((name, tensor.dtype) for name, tensor in given.items()), autocast)
        if key not in self.graphs:
            inputs = {name: tensor.new_empty(shape) for name, tensor in given.items()}
            _fill(inputs, given, self.pad_token_id)  # real data: the kernels autotune on a real workload
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self.model(**inputs, **self.forward_kwargs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.model(**inputs, **self.forward_kwargs)
            self.graphs[key] = _Graph(inputs, graph, outputs)
        return self.graphs[key]

    def _real_part(self, outputs, names: tuple[str, ...], batch: int, length: int, copy: bool):
        """outputs cut to the first `batch` rows and `length` positions (copied when `copy`)."""
        leaves, spec = pytree.tree_flatten(outputs)
        cut = []
        for leaf, (batch_dims, length_dims) in zip(leaves, self._dims(names)):
            index = [slice(None)] * leaf.dim()
            for dim in batch_dims:
                index[dim] = slice(0, batch)
            for dim in length_dims:
                index[dim] = slice(0, length)
            part = leaf[tuple(index)]
            cut.append(part.clone() if copy else part)
        return pytree.tree_unflatten(cut, spec)

    def _dims(self, names: tuple[str, ...]) -> list[tuple[list[int], list[int]]]:
        """Per output tensor: its batch dims and its length dims, from two forwards on meta tensors (shapes
        only: nothing runs on the device) at the _PROBE_SHAPES."""
        if names not in self._output_dims:
            meta = {name: torch.empty_like(t, device="meta")
                    for name, t in (*self.model.named_parameters(), *self.model.named_buffers())}
            shapes = []
            for probe in _PROBE_SHAPES:
                inputs = {name: torch.zeros(probe, dtype=torch.long, device="meta") for name in names}
                outputs = functional_call(self.model, meta, (), {**inputs, **self.forward_kwargs})
                shapes.append([tuple(leaf.shape) for leaf in pytree.tree_leaves(outputs)])
            dims = []
            for first, second in zip(*shapes):
                changes = list(zip(first, second))
                if len(first) != len(second) or any(a != b and (a, b) not in (_BATCH_CHANGE, _LENGTH_CHANGE)
                                                    for a, b in changes):
                    raise ValueError(f"an output of shape {first} at inputs {_PROBE_SHAPES[0]} and {second} at "
                                     f"{_PROBE_SHAPES[1]} is neither per sequence nor per token")
                dims.append(([d for d, c in enumerate(changes) if c == _BATCH_CHANGE],
                             [d for d, c in enumerate(changes) if c == _LENGTH_CHANGE]))
            self._output_dims[names] = dims
        return self._output_dims[names]


def _fill(static: dict, given: dict, pad_token_id: int) -> None:
    """Each static input [batch', length'] holds the given tensor in its corner and padding elsewhere: the pad
    token in input_ids, 0 in the attention mask and the token types."""
    for name, tensor in static.items():
        tensor.fill_(pad_token_id if name == "input_ids" else 0)
        if name in given:
            source = given[name]
            tensor[:source.shape[0], :source.shape[1]].copy_(source)
