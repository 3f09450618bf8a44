"""Per-rank batches of a pretraining run, as a pure function of the position in the example stream.

The stream of a phase is the concatenation of epochs, each a permutation of the dataset keyed by
(seed, phase, epoch), the same on every rank. An optimizer step consumes the next global_batch_size
examples of the stream; rank r of W takes the r-th of W equal slices and cuts it into micro-batches
(gradient accumulation). Every example is masked with its own random stream keyed by (seed, phase,
epoch, example), so that a step's examples and masks depend only on the stream position, not on the
number of ranks or on where a run was resumed: the data position saved in a checkpoint is a single
integer, the number of examples consumed.

The epoch permutation is a keyed Feistel network over the index range, cycle-walked into [0, N): a
position is mapped to its example in O(1) time and memory, so no rank ever builds an N-entry table
(36M examples would be 288 MB and half a minute per rank at each epoch and phase start). A micro-batch
is built with numpy over the whole batch at once: indices, reading from the memory-mapped shards,
padding and masking (fastbert.data.masking).
"""
from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from fastbert.data.masking import ExampleBatch, MaskingCollator, hash_keys, mix64, mix_in
from fastbert.data.shards import ShardedDataset

FEISTEL_ROUNDS = 4  # a keyed Feistel network of 4 rounds is a pseudo-random permutation (Luby-Rackoff)


@functools.lru_cache(maxsize=8)
def epoch_key(seed: int, phase: int, epoch: int) -> int:
    """The key of an epoch's permutation, and the start of its examples' keys."""
    return int(hash_keys(seed, phase, epoch)[0])


@functools.lru_cache(maxsize=8)
def _round_keys(key: int) -> np.ndarray:
    return mix64(np.uint64(key) ^ np.arange(1, FEISTEL_ROUNDS + 1, dtype=np.uint64))  # uint64 [rounds]


def permute(offsets: np.ndarray, size: int, key: int) -> np.ndarray:
    """int64 [N]: the images of offsets (int64 [N] in [0, size)) under the bijection of [0, size) keyed by key.

    A Feistel network permutes the n-bit numbers [0, 2^n), 2^n >= size: a round maps (left, right) to
    (right, left ^ F(right)), F a keyed hash, the halves of floor(n/2) and ceil(n/2) bits trading places
    (an unbalanced network, so that 2^n < 2 size whatever n is). A result outside [0, size) is sent
    through the network again (cycle walking), which keeps the map a bijection of [0, size): fewer than
    2 passes through the network per offset on average, in O(1) time and memory per offset.
    """
    bits = max(size - 1, 1).bit_length()
    values = offsets.astype(np.uint64)
    pending, where = values, slice(None)  # the offsets not yet inside [0, size): first all of them
    while len(pending):
        left_bits, right_bits = bits - bits // 2, bits // 2
        left, right = pending >> np.uint64(right_bits), pending & np.uint64((1 << right_bits) - 1)
        for round_key in _round_keys(int(key)):
            left, right = right, left ^ (mix64(right ^ round_key) & np.uint64((1 << left_bits) - 1))
            left_bits, right_bits = right_bits, left_bits
        values[where] = (left << np.uint64(right_bits)) | right
        where = np.flatnonzero(values >= size)
        pending = values[where]
    return values.astype(np.int64)


class ShardReader:
    """Reads examples of a dataset as padded batches: one vectorised read per shard a batch touches
    (records, then tokens), never one per example."""

    def __init__(self, dataset: ShardedDataset):
        self.starts = dataset._starts
        # plain ndarray views of the memory maps: np.memmap's indexing costs a subclass round trip per call
        self.records = [np.asarray(index) for index in dataset._index]
        self.tokens = [np.asarray(tokens) for tokens in dataset._tokens]

    def read(self, indices: np.ndarray, pad_id: int, pad_to_multiple_of: int) -> ExampleBatch:
        """The examples of `indices` (int64 [B]) padded to the longest rounded up to pad_to_multiple_of."""
        shard = np.searchsorted(self.starts, indices, side="right") - 1
        local = indices - self.starts[shard]
        by_shard = np.argsort(shard, kind="stable")
        bounds = [0, *(np.flatnonzero(np.diff(shard[by_shard])) + 1).tolist(), len(indices)]
        rows_of = [(int(shard[by_shard[a]]), by_shard[a:b]) for a, b in zip(bounds, bounds[1:])]  # (shard, its rows)
        records = np.empty(len(indices), dtype=self.records[0].dtype)
        for s, rows in rows_of:
            records[rows] = self.records[s][local[rows]]
        lengths = records["length"].astype(np.int64)
        seqlen = -(-int(lengths.max()) // pad_to_multiple_of) * pad_to_multiple_of
        positions = np.arange(seqlen)
        # [B, S]: where each token is in its shard (the last token repeated over the padding)
        spans = records["offset"][:, None] + np.minimum(positions, lengths[:, None] - 1)
        tokens = np.empty((len(indices), seqlen), dtype=np.int64)
        for s, rows in rows_of:
            tokens[rows] = self.tokens[s][spans[rows]]
        tokens[positions >= lengths[:, None]] = pad_id
        return ExampleBatch(tokens, lengths, records["a_length"].astype(np.int64),
                            records["next_sentence_label"].astype(np.int64))


class PretrainingLoader:
    """Micro-batches for one rank.

    steps(start) yields, for each optimizer step from stream position `start` on, the list of this
    rank's micro-batches (dicts from MaskingCollator). Raises ValueError when the global batch does
    not divide into world_size * micro_batch_size.

    Several steps are built together, at least rows_per_build rows (numpy's cost per call is then
    spread over many rows), and cut into micro-batches each padded to its own longest example: the
    tensors are those of micro-batches built one by one, since an example's mask depends only on its
    key and its own tokens.
    """

    def __init__(self, dataset: ShardedDataset, collator: MaskingCollator, global_batch_size: int,
                 micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, phase: int = 0,
                 pad_to_multiple_of: int = 8, rows_per_build: int = 256):
        if global_batch_size % (world_size * micro_batch_size):
            raise ValueError(f"global batch size {global_batch_size} must be a multiple of world size {world_size} "
                             f"x micro-batch size {micro_batch_size}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of!r}")
        self.dataset, self.collator = dataset, collator
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size, self.seed, self.phase = rank, world_size, seed, phase
        self.pad_to_multiple_of = pad_to_multiple_of
        self.per_rank = global_batch_size // world_size
        self.steps_per_build = max(1, rows_per_build // self.per_rank)
        self.reader = ShardReader(dataset)

    def examples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index int64 [N], key uint64 [N]) of the examples at stream positions (int64 [N]).

        An example's key is hash_keys(seed, phase, epoch, index): its masks' random stream.
        """
        epochs, offsets = np.divmod(positions, len(self.dataset))
        indices, keys = np.empty_like(offsets), np.empty(len(offsets), dtype=np.uint64)
        for epoch in np.unique(epochs).tolist():  # one, or two at an epoch's end
            inside = epochs == epoch
            key = epoch_key(self.seed, self.phase, epoch)
            indices[inside] = permute(offsets[inside], len(self.dataset), key)
            keys[inside] = mix_in(key, indices[inside])
        return indices, keys

    def build(self, position: int, count: int) -> list[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches of the `count` optimizer steps that start at stream position `position`."""
        firsts = position + self.global_batch_size * np.arange(count) + self.rank * self.per_rank  # [count]
        indices, keys = self.examples((firsts[:, None] + np.arange(self.per_rank)).reshape(-1))
        batch = self.reader.read(indices, self.collator.pad_id, self.pad_to_multiple_of)
        arrays = self.collator(batch, keys)
        multiple, micro = self.pad_to_multiple_of, self.micro_batch_size
        micro_batches = []
        for first in range(0, len(indices), micro):
            width = -(-int(batch.lengths[first:first + micro].max()) // multiple) * multiple
            micro_batches.append({k: torch.from_numpy(np.ascontiguousarray(v[first:first + micro, :width] if v.ndim == 2
                                                                           else v[first:first + micro]))
                                  for k, v in arrays.items()})
        per_step = self.per_rank // micro
        return [micro_batches[i:i + per_step] for i in range(0, len(micro_batches), per_step)]

    def step(self, position: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the optimizer step that starts at stream position `position`."""
        return self.build(position, 1)[0]

    def steps(self, start: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        position = start
        while True:
            yield from self.build(position, self.steps_per_build)
            position += self.steps_per_build * self.global_batch_size


def prefetch(iterator: Iterator, depth: int = 2, pin_memory: bool = False, threads: int = 1) -> Iterator:
    """Run `iterator` in a background thread, `depth` items ahead; exceptions re-raise in the consumer.

    The thread runs torch's intra-op work on `threads` threads (a new thread otherwise starts at
    torch's default, one per core, and would compete with the training loop for the cores). With
    pin_memory, the tensors in the items (any nesting of lists, tuples and dicts) are pinned, so that
    copies to the GPU can be asynchronous. Closing the returned generator (or its garbage collection)
    stops the thread and waits for it: no thread is left running torch code while the interpreter
    shuts down, which aborts the process ("terminate called without an active exception").
    """
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def offer(item) -> None:  # put, unless the consumer has gone
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def produce():
        try:
            torch.set_num_threads(threads)
            for item in iterator:
                if pin_memory:
                    item = tree_map_only(torch.Tensor, torch.Tensor.pin_memory, item)
                offer(item)
                if stop.is_set():
                    return
            offer(done)
        except BaseException as exc:  # handed to the consumer, which raises it
            offer(exc)

    thread = threading.Thread(target=produce, daemon=True, name="fastbert-prefetch")
    thread.start()
    try:
        while True:
            item = items.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
