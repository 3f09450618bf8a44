"""Per-rank batches of a pretraining run, as a pure function of the position in the example stream.

The stream of a phase is the concatenation of epochs, each a permutation of the dataset drawn from
(seed, phase, epoch), the same on every rank. An optimizer step consumes the next global_batch_size
examples of the stream; rank r of W takes the r-th of W equal slices and cuts it into micro-batches
(gradient accumulation). Every example is masked with its own generator seeded from (seed, phase,
epoch, example), so that a step's examples and masks depend only on the stream position, not on the
number of ranks or on where a run was resumed: the data position saved in a checkpoint is a single
integer, the number of examples consumed.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from fastbert.data.masking import MaskingCollator, example_seed
from fastbert.data.shards import ShardedDataset


class PretrainingLoader:
    """Micro-batches for one rank.

    steps(start) yields, for each optimizer step from stream position `start` on, the list of this
    rank's micro-batches (dicts from MaskingCollator). Raises ValueError when the global batch does
    not divide into world_size * micro_batch_size.
    """

    def __init__(self, dataset: ShardedDataset, collator: MaskingCollator, global_batch_size: int,
                 micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, phase: int = 0):
        if global_batch_size % (world_size * micro_batch_size):
            raise ValueError(f"global batch size {global_batch_size} must be a multiple of world size {world_size} "
                             f"x micro-batch size {micro_batch_size}")
        self.dataset, self.collator = dataset, collator
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size, self.seed, self.phase = rank, world_size, seed, phase
        self.per_rank = global_batch_size // world_size
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a step spans at most two epochs
                del self._permutations[min(self._permutations)]
            rng = np.random.default_rng([self.seed, self.phase, epoch])
            self._permutations[epoch] = rng.permutation(len(self.dataset))
        return self._permutations[epoch]

    def micro_batch(self, first: int) -> dict[str, torch.Tensor]:
        """The micro-batch of stream positions [first, first + micro_batch_size)."""
        examples, seeds = [], []
        for position in range(first, first + self.micro_batch_size):
            epoch, offset = divmod(position, len(self.dataset))
            index = int(self.permutation(epoch)[offset])
            examples.append(self.dataset[index])
            seeds.append(example_seed(self.seed, self.phase, epoch, index))
        return self.collator(examples, seeds)

    def step(self, position: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the optimizer step that starts at stream position `position`."""
        first = position + self.rank * self.per_rank
        return [self.micro_batch(start) for start in range(first, first + self.per_rank, self.micro_batch_size)]

    def steps(self, start: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        position = start
        while True:
            yield self.step(position)
            position += self.global_batch_size


def prefetch(iterator: Iterator, depth: int = 2, pin_memory: bool = False) -> Iterator:
    """Run `iterator` in a background thread, `depth` items ahead; exceptions re-raise in the consumer.

    With pin_memory, the tensors in the items (any nesting of lists, tuples and dicts) are pinned, so
    that copies to the GPU can be asynchronous. Closing the returned generator (or its garbage
    collection) stops the thread and waits for it: no thread is left running torch code while the
    interpreter shuts down, which aborts the process ("terminate called without an active exception").
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
