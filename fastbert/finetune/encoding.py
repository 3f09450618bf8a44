"""Tokenizer loading and BERT's input packing, shared by every task and by `fastbert embed`.

A sequence is packed as BERT's: [CLS] A [SEP] (B [SEP]), token types 0 for A and 1 for B. Pairs that
are too long lose tokens from the end of the longer side first (the paper's "longest first").
Batches are padded to their longest sequence, not to max_seq_length.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from fastbert.data.tokenizer import load_tokenizer, save_tokenizer
from fastbert.validation import IGNORE_INDEX

# files an HF tokenizer directory may hold besides tokenizer.json / vocab.txt; copied to the output
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_for(model_dir: str, path: str | None = None, lowercase: bool | None = None):
    """The tokenizer of a checkpoint: `path` (tokenizer.json or vocab.txt) when given, else the model
    directory's tokenizer.json, else its vocab.txt. Padding and truncation are switched off (packing
    is done here). lowercase (vocab.txt only) defaults to tokenizer_config.json's do_lower_case, else True."""
    if path is None:
        for name in ("tokenizer.json", "vocab.txt"):
            if os.path.isfile(os.path.join(model_dir, name)):
                path = os.path.join(model_dir, name)
                break
        else:
            raise ValueError(f"--model {model_dir} has no tokenizer.json or vocab.txt; pass --tokenizer "
                             "(fastbert prepare-data writes both into its output directory)")
    if lowercase is None:
        lowercase = True
        config = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                lowercase = bool(json.load(f).get("do_lower_case", True))
    tokenizer = load_tokenizer(path, lowercase)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def save_tokenizer_files(tokenizer, model_dir: str, out: str) -> None:
    """tokenizer.json and vocab.txt into out, with the source directory's tokenizer_config.json and
    special_tokens_map.json, so that transformers' AutoTokenizer loads the same tokenizer from out."""
    save_tokenizer(tokenizer, out)
    for name in TOKENIZER_SIDE_FILES:
        source = os.path.join(model_dir, name)
        if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(os.path.join(out, name)):
            shutil.copyfile(source, os.path.join(out, name))


class Packer:
    """Token ids -> BERT inputs of at most max_seq_length tokens."""

    def __init__(self, tokenizer, max_seq_length: int):
        ids = {name: tokenizer.token_to_id(name) for name in ("[CLS]", "[SEP]", "[PAD]")}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer has no {missing} token; BERT inputs need [CLS], [SEP] and [PAD]")
        if max_seq_length < 4:
            raise ValueError(f"max_seq_length must be at least 4 ([CLS] a [SEP] b [SEP]), got {max_seq_length}")
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.cls_id, self.sep_id, self.pad_id = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pack(self, a: list[int], b: list[int] | None = None) -> dict[str, list[int]]:
        """[CLS] a [SEP] (b [SEP]), truncated longest-first to max_seq_length."""
        budget = self.max_seq_length - (2 if b is None else 3)
        keep_a, keep_b = len(a), 0 if b is None else len(b)
        while keep_a + keep_b > budget:
            if keep_a > keep_b:
                keep_a -= 1
            else:
                keep_b -= 1
        input_ids = [self.cls_id, *a[:keep_a], self.sep_id]
        token_type_ids = [0] * len(input_ids)
        if b is not None:
            input_ids += [*b[:keep_b], self.sep_id]
            token_type_ids += [1] * (keep_b + 1)
        return {"input_ids": input_ids, "token_type_ids": token_type_ids}

    def pack_texts(self, texts_a: list[str], texts_b: list[str] | None = None) -> list[dict[str, list[int]]]:
        a = self.tokenize(texts_a)
        b = self.tokenize(texts_b) if texts_b is not None else [None] * len(a)
        return [self.pack(x, y) for x, y in zip(a, b)]


def _pad(rows: list, value: int) -> torch.Tensor:
    """Nested lists (ragged in their last dimension) -> a tensor padded at the end with value."""
    if rows and isinstance(rows[0][0], list):  # [B][C][S]: multiple choice
        width = max(len(s) for choices in rows for s in choices)
        return torch.tensor([[s + [value] * (width - len(s)) for s in choices] for choices in rows])
    width = max(len(s) for s in rows)
    return torch.tensor([s + [value] * (width - len(s)) for s in rows])


def collate(features: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Model inputs padded to the batch's longest sequence: input_ids with [PAD], attention_mask 1/0,
    token labels with -100; scalar labels and positions stacked."""
    batch = {"input_ids": _pad([f["input_ids"] for f in features], pad_id)}
    batch["attention_mask"] = _pad([_ones(f["input_ids"]) for f in features], 0)
    batch["token_type_ids"] = _pad([f["token_type_ids"] for f in features], 0)
    for key in features[0].keys() - {"input_ids", "token_type_ids"}:
        values = [f[key] for f in features]
        batch[key] = _pad(values, IGNORE_INDEX) if isinstance(values[0], list) else torch.tensor(values)
    return batch


def _ones(ids: list) -> list:
    return [_ones(s) for s in ids] if ids and isinstance(ids[0], list) else [1] * len(ids)
