"""Memory-mapped example shards and the dataset index that ties them together.

A dataset directory (one per max_seq_length) holds:
- shard_NNNNN.bin: the token ids of its examples, back to back, little-endian uint16 (uint32 when
  the vocabulary has more than 65536 entries);
- shard_NNNNN.idx.npy: one record per example, INDEX_DTYPE: offset (in tokens) into the .bin,
  length, a_length (tokens of [CLS] A [SEP]) and next_sentence_label;
- vocab.txt: the vocabulary, so that training needs no tokenizer library;
- index.json: format version, max_seq_length, vocab size, token dtype, special token ids, and the
  shards with their example and token counts. It is written last: a directory without it is not a
  dataset.
Both files of a shard are opened with np.memmap / np.load(mmap_mode="r"), so a reader touches only
the pages of the examples it reads: each rank of a multi-GPU run reads its own examples and nothing
else, and the OS page cache is shared by the ranks of a node.
"""
from __future__ import annotations

import json
import os

import numpy as np

from fastbert.data.examples import Example

FORMAT_VERSION = 1
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("length", "<u2"), ("a_length", "<u2"), ("next_sentence_label", "u1")])
INDEX_FILE = "index.json"
VOCAB_FILE = "vocab.txt"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(number: int) -> str:
    return f"shard_{number:05d}"


def _fsync_write(path: str, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_shard(directory: str, name: str, examples: list[Example], vocab_size: int) -> dict:
    """Write one shard; returns its index.json entry {"name", "examples", "tokens"}."""
    lengths = np.fromiter((len(e.tokens) for e in examples), dtype=np.int64, count=len(examples))
    index = np.zeros(len(examples), dtype=INDEX_DTYPE)
    index["offset"] = np.cumsum(lengths) - lengths
    index["length"] = lengths
    index["a_length"] = [e.a_length for e in examples]
    index["next_sentence_label"] = [e.next_sentence_label for e in examples]
    tokens = np.fromiter((t for e in examples for t in e.tokens), dtype=token_dtype(vocab_size),
                         count=int(lengths.sum()))
    _fsync_write(os.path.join(directory, name + ".bin"), tokens.tobytes())
    with open(os.path.join(directory, name + ".idx.npy"), "wb") as f:
        np.save(f, index)
        f.flush()
        os.fsync(f.fileno())
    return {"name": name, "examples": len(examples), "tokens": int(lengths.sum())}


def write_index(directory: str, metadata: dict) -> None:
    """index.json, written atomically (temporary file, fsync, rename)."""
    tmp = os.path.join(directory, INDEX_FILE + ".tmp")
    _fsync_write(tmp, (json.dumps({"format_version": FORMAT_VERSION, **metadata}, indent=2) + "\n").encode())
    os.replace(tmp, os.path.join(directory, INDEX_FILE))


class ShardedDataset:
    """Random access to the examples of a dataset directory, over all shards, without loading them.

    `dataset[i]` -> (tokens int64 [length], a_length, next_sentence_label).
    Raises ValueError naming the directory when it is not a complete dataset.
    """

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_FILE)
        if not os.path.isfile(index_path):
            raise ValueError(f"{directory!r} is not a prepared dataset (no {INDEX_FILE}); "
                             "create one with `fastbert prepare-data`")
        with open(index_path, encoding="utf-8") as f:
            self.metadata = json.load(f)
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{index_path}: format_version {self.metadata.get('format_version')!r}, "
                             f"this fastbert reads {FORMAT_VERSION}")
        self.directory = directory
        self.max_seq_length = int(self.metadata["max_seq_length"])
        self.vocab_size = int(self.metadata["vocab_size"])
        self.special_ids = {k: int(v) for k, v in self.metadata["special_ids"].items()}
        dtype = token_dtype(self.vocab_size)
        self._tokens, self._index = [], []
        for shard in self.metadata["shards"]:
            base = os.path.join(directory, shard["name"])
            index = np.load(base + ".idx.npy", mmap_mode="r")
            if len(index) != shard["examples"] or os.path.getsize(base + ".bin") != shard["tokens"] * dtype.itemsize:
                raise ValueError(f"{base}: shard files do not match {INDEX_FILE} (truncated or overwritten?)")
            self._index.append(index)
            # np.memmap cannot map an empty file
            self._tokens.append(np.memmap(base + ".bin", dtype=dtype, mode="r") if shard["tokens"]
                                else np.zeros(0, dtype=dtype))
        self._starts = np.cumsum([0] + [len(i) for i in self._index])
        if self._starts[-1] == 0:
            raise ValueError(f"{directory!r} holds no examples")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range for a dataset of {len(self)}")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        record = self._index[shard][i - self._starts[shard]]
        offset, length = int(record["offset"]), int(record["length"])
        tokens = self._tokens[shard][offset:offset + length].astype(np.int64)
        return tokens, int(record["a_length"]), int(record["next_sentence_label"])

    def vocabulary(self) -> list[str]:
        from fastbert.data.tokenizer import read_vocab
        return read_vocab(os.path.join(self.directory, VOCAB_FILE))
