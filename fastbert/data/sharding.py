"""One chunk of the corpus -> one shard per sequence length: what each `fastbert prepare-data` worker runs.

The chunk's documents are tokenised into one flat array of ids (4 bytes per token, 8 per sentence),
never a Python object per token, and examples go to the shard files as they are made: a worker's
memory follows the chunk's size, not the corpus's. The random generator of a shard is seeded from
the run's seed, the chunk's number and the sequence length, so the shard does not depend on which
worker builds it or when.
"""
from __future__ import annotations

import array
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fastbert.data.corpus import Segment, segment_documents
from fastbert.data.examples import MLM, Example, iter_examples, pack_full_sentences
from fastbert.data.shards import ShardWriter, shard_name
from fastbert.files import write_text

ENCODE_BATCH = 4096  # sentences given to the tokenizer at once


class TokenizedDocument(Sequence):
    """A document's sentences as a view into its chunk's flat token array: document[i] is a list of ids."""

    def __init__(self, tokens: array.array, bounds: array.array, first: int, last: int):
        self.tokens, self.bounds, self.first, self.last = tokens, bounds, first, last

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.tokens[self.bounds[self.first + i]:self.bounds[self.first + i + 1]].tolist()


def tokenize_chunk(segments: list[Segment], tokenizer, encoding_errors: str) -> list[TokenizedDocument]:
    """The chunk's documents, tokenised into one flat array (4 bytes per token, 8 per sentence).
    Sentences that tokenise to nothing are dropped, then documents left without a sentence."""
    tokens, bounds = array.array("I"), array.array("q", [0])  # sentence s: tokens[bounds[s]:bounds[s + 1]]
    document_bounds = [0]  # document d: sentences document_bounds[d] to document_bounds[d + 1]
    pending: list[list[str]] = []  # documents read, not yet tokenised
    pending_sentences = 0

    def encode() -> None:
        # at most ENCODE_BATCH sentences' Encoding objects (ids, tokens, offsets: ~2 KB each) at a time,
        # even when one document (a book) holds many more
        sentences = [s for d in pending for s in d]
        encoded = (e for start in range(0, len(sentences), ENCODE_BATCH)
                   for e in tokenizer.encode_batch(sentences[start:start + ENCODE_BATCH], add_special_tokens=False))
        for document in pending:
            for _ in document:
                ids = next(encoded).ids
                if ids:
                    tokens.extend(ids)
                    bounds.append(len(tokens))
            if len(bounds) - 1 > document_bounds[-1]:
                document_bounds.append(len(bounds) - 1)
        pending.clear()

    for segment in segments:
        for document in segment_documents(segment, encoding_errors):
            pending.append(document)
            pending_sentences += len(document)
            if pending_sentences >= ENCODE_BATCH:
                encode()
                pending_sentences = 0
    encode()
    return [TokenizedDocument(tokens, bounds, a, b) for a, b in zip(document_bounds, document_bounds[1:])]


@dataclass
class ShardParams:
    """What every shard of a run is built with."""
    seed: int
    short_seq_prob: float
    dupe_factor: int
    vocab_size: int
    cls_id: int
    sep_id: int
    encoding_errors: str
    objective: str  # examples.OBJECTIVES: NSP pairs, or full sentences packed for the masked LM alone


_worker: dict = {}  # in each worker process: its tokenizer and the run's ShardParams


def start_worker(tokenizer_json: str, params: ShardParams, one_thread: bool) -> None:
    from tokenizers import Tokenizer

    if one_thread:  # the pool is the parallelism: a tokenizer thread pool per worker would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=Tokenizer.from_str(tokenizer_json), params=params)


def marker_path(directory: str, number: int) -> str:
    """Written after a shard's two files: the shard is complete (it holds its index entry)."""
    return os.path.join(directory, shard_name(number) + ".json")


def build_shards(job: tuple[int, list[Segment], dict[int, str]]) -> int:
    """Tokenise chunk `number` and write its shard into each {max_seq_length: partial directory}, each
    followed by its marker (the index entry and the chunk's document count). Returns the chunk's bytes."""
    number, segments, directories = job
    params: ShardParams = _worker["params"]
    documents = tokenize_chunk(segments, _worker["tokenizer"], params.encoding_errors)
    count = len(documents)
    if params.objective != MLM and count == 1 and len(documents[0]) >= 2:
        # one document longer than a chunk: its halves serve NSP
        only = documents[0]
        middle = only.first + len(only) // 2
        documents = [TokenizedDocument(only.tokens, only.bounds, only.first, middle),
                     TokenizedDocument(only.tokens, only.bounds, middle, only.last)]
    for max_seq_length, directory in directories.items():
        with ShardWriter(directory, shard_name(number), params.vocab_size) as writer:
            for example in chunk_examples(documents, max_seq_length, params, number):
                writer.add(example.tokens, example.a_length, example.next_sentence_label)
            entry = writer.finish()
        write_text(marker_path(directory, number), json.dumps({**entry, "documents": count}) + "\n")
    return sum(s.end - s.start for s in segments)


def chunk_examples(documents: list[TokenizedDocument], max_seq_length: int, params: ShardParams,
                   number: int) -> Iterator[Example]:
    """The examples of chunk `number` at one length: its sentences packed in order (mlm), or NSP pairs
    (mlm+nsp; none from a chunk of one document, which has no other to draw segment B from)."""
    if params.objective == MLM:
        return pack_full_sentences(documents, max_seq_length, params.cls_id, params.sep_id)
    if len(documents) < 2:
        return iter(())
    rng = random.Random(f"{params.seed}-{number}-{max_seq_length}")
    return iter_examples(documents, max_seq_length, params.short_seq_prob, params.dupe_factor, params.cls_id,
                         params.sep_id, rng)


def stop_worker() -> None:
    """Drop the tokenizer start_worker loaded (when the shards were built in the calling process)."""
    _worker.clear()
