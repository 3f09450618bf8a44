"""Memory-mapped example shards and the dataset index that ties them together.

A dataset directory (one per max_seq_length) holds:
- shard_NNNNN.bin: the token ids of its examples, back to back, little-endian uint16 (uint32 when
  the vocabulary has more than 65536 entries);
- shard_NNNNN.idx.npy: one record per example, INDEX_DTYPE: offset (in tokens) into the .bin,
  length, a_length (tokens of [CLS] A [SEP]; the whole example for the mlm objective) and
  next_sentence_label (0 for mlm, which has none);
- vocab.txt: the vocabulary, so that training needs no tokenizer library;
- index.json: format version, max_seq_length, vocab size, special token ids, the shards with their
  example and token counts and sha256, the sha256 of the tokenizer, a fingerprint of the whole
  dataset (tokenizer and shards) and the options that made it, among them the objective the examples
  are for (examples.OBJECTIVES; absent in datasets made before mlm, which are mlm+nsp). It is written
  last: a directory without it is not a dataset.
Both files of a shard are opened with np.memmap / np.load(mmap_mode="r"), so a reader touches only
the pages of the examples it reads: each rank of a multi-GPU run reads its own examples and nothing
else, and the OS page cache is shared by the ranks of a node.
"""
from __future__ import annotations

import array
import hashlib
import io
import json
import os

import numpy as np

from fastbert.data.examples import MLM_NSP, Example
from fastbert.files import write_text

FORMAT_VERSION = 1
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("length", "<u2"), ("a_length", "<u2"), ("next_sentence_label", "u1")])
INDEX_FILE = "index.json"
INDEX_KEYS = ("max_seq_length", "vocab_size", "special_ids", "shards")
VOCAB_FILE = "vocab.txt"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(number: int) -> str:
    return f"shard_{number:05d}"


class ShardWriter:
    """One shard written example by example: tokens go to NAME.bin through a bounded buffer, the index
    is kept as compact arrays, so memory does not grow with the shard's size. finish() writes
    NAME.idx.npy, fsyncs both files and returns the shard's index.json entry, with the sha256 of its
    two files (a fingerprint of the data that a resumed run can compare)."""

    def __init__(self, directory: str, name: str, vocab_size: int, buffer_tokens: int = 1 << 20):
        self.directory, self.name = directory, name
        self.dtype = token_dtype(vocab_size)
        self.buffer_tokens = buffer_tokens
        self.paths = [os.path.join(directory, name + ".bin"), os.path.join(directory, name + ".idx.npy")]
        self.file = open(self.paths[0], "wb")
        self.digest = hashlib.sha256()
        self.pending = array.array("I")  # tokens not yet written
        self.lengths, self.a_lengths, self.labels = array.array("H"), array.array("H"), array.array("B")
        self.tokens = 0

    def add(self, tokens: list[int], a_length: int, next_sentence_label: int) -> None:
        self.pending.extend(tokens)
        self.lengths.append(len(tokens))
        self.a_lengths.append(a_length)
        self.labels.append(next_sentence_label)
        self.tokens += len(tokens)
        if len(self.pending) >= self.buffer_tokens:
            self._flush()

    def _flush(self) -> None:
        data = np.frombuffer(self.pending, dtype=np.uint32).astype(self.dtype).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.pending = array.array("I")

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A shard left unfinished (a full disk, Ctrl-C) is removed: it would hold space, and a rerun writes it
        anew."""
        if error is not None:
            self.file.close()
            for path in self.paths:
                if os.path.exists(path):
                    os.remove(path)

    def finish(self) -> dict:
        self._flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        lengths = np.frombuffer(self.lengths, dtype=np.uint16).astype(np.int64)
        index = np.zeros(len(lengths), dtype=INDEX_DTYPE)
        index["offset"] = np.cumsum(lengths) - lengths
        index["length"] = lengths
        index["a_length"] = np.frombuffer(self.a_lengths, dtype=np.uint16)
        index["next_sentence_label"] = np.frombuffer(self.labels, dtype=np.uint8)
        npy = io.BytesIO()  # written by f.write: a failed write is an OSError with its errno (numpy's own has none)
        np.save(npy, index)
        with open(self.paths[1], "wb") as f:
            f.write(npy.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        self.digest.update(index.tobytes())
        return {"name": self.name, "examples": len(index), "tokens": self.tokens, "sha256": self.digest.hexdigest()}


def write_shard(directory: str, name: str, examples: list[Example], vocab_size: int) -> dict:
    """Write one shard from a list of examples; returns its index.json entry (see ShardWriter)."""
    with ShardWriter(directory, name, vocab_size) as writer:
        for example in examples:
            writer.add(example.tokens, example.a_length, example.next_sentence_label)
        return writer.finish()


def write_index(directory: str, metadata: dict) -> None:
    """index.json, written atomically (temporary file, fsync, rename)."""
    write_text(os.path.join(directory, INDEX_FILE),
               json.dumps({"format_version": FORMAT_VERSION, **metadata}, indent=2) + "\n")


def read_index(directory: str) -> dict:
    """index.json's contents; ValueError naming the file when it is missing, damaged or of another version."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index_path):
        raise ValueError(f"{directory!r} is not a prepared dataset (no {INDEX_FILE}); "
                         "create one with `fastbert prepare-data`")
    try:
        with open(index_path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index_path}: damaged ({exc}); prepare the dataset again") from None
    if not isinstance(metadata, dict) or metadata.get("format_version") != FORMAT_VERSION:
        version = metadata.get("format_version") if isinstance(metadata, dict) else None
        raise ValueError(f"{index_path}: format_version {version!r}, this fastbert reads {FORMAT_VERSION}; "
                         "prepare the dataset again")
    missing = [key for key in INDEX_KEYS if key not in metadata]
    if missing:
        raise ValueError(f"{index_path}: damaged (no {', '.join(missing)}); prepare the dataset again")
    return metadata


class ShardedDataset:
    """Random access to the examples of a dataset directory, over all shards, without loading them.

    `dataset[i]` -> (tokens int64 [length], a_length, next_sentence_label).
    Raises ValueError naming the directory when it is not a complete dataset.
    """

    def __init__(self, directory: str):
        self.metadata = read_index(directory)
        self.directory = directory
        self.max_seq_length = int(self.metadata["max_seq_length"])
        self.vocab_size = int(self.metadata["vocab_size"])
        self.special_ids = {k: int(v) for k, v in self.metadata["special_ids"].items()}
        # what the examples were made for: NSP pairs or full sentences (datasets older than the option: NSP)
        self.objective = self.metadata.get("options", {}).get("objective", MLM_NSP)
        dtype = token_dtype(self.vocab_size)
        self._tokens, self._index = [], []
        for shard in self.metadata["shards"]:
            base = os.path.join(directory, shard["name"])
            try:
                index = np.load(base + ".idx.npy", mmap_mode="r")
                matches = (len(index) == shard["examples"]
                           and os.path.getsize(base + ".bin") == shard["tokens"] * dtype.itemsize)
            except (OSError, ValueError):
                matches = False
            if not matches:
                raise ValueError(f"{base}: shard files missing or do not match {INDEX_FILE} (truncated or "
                                 "overwritten?); prepare the dataset again")
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
