"""Tokenizer loading and input packing, shared by every task and by `fastbert embed`.

A sequence is packed as the tokenizer's own post-processor lays it out (its template, read once from the
tokenizer): BERT's [CLS] A [SEP] (B [SEP]) with token types 0 for A and 1 for B, RoBERTa's and XLM-R's
<s> A </s> (</s> B </s>), MPNet's the same on a WordPiece vocabulary. Pairs that are too long lose tokens
from the end of the longer side first (the paper's "longest first"). Models without token types
(RoBERTa's single type, DistilBERT, MPNet) get no token_type_ids. Batches are padded to their longest
sequence, not to max_seq_length.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import torch

from fastbert.data.tokenizer import check_special_tokens, load_tokenizer, lowercases, save_tokenizer
from fastbert.validation import IGNORE_INDEX

# files an HF tokenizer directory may hold besides tokenizer.json / vocab.txt; copied to the output
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# what transformers' BERT tokenizer reads beside vocab.txt: its settings, and tokens added to the vocabulary
BERT_TOKENIZER_SETTINGS = ("tokenizer_config.json", "added_tokens.json")
# the family's tokenizer files that transformers' AutoTokenizer reads when there is no tokenizer.json:
# byte-level BPE (RoBERTa), SentencePiece (XLM-R, CamemBERT), WordPiece with its own template (MPNet)
VOCABULARY_FILES = ("vocab.json", "sentencepiece.bpe.model", "spiece.model", "vocab.txt")
PAD_TOKENS = ("[PAD]", "<pad>")
PROBE_TEXT = "a"  # any text the tokenizer turns into at least one token: its template is read around it


def _auto_tokenizer(directory: str, flag: str, **kwargs):
    """The `tokenizers.Tokenizer` inside transformers' AutoTokenizer of a directory (it converts
    SentencePiece and vocab.json + merges.txt files into one); kwargs go to its from_pretrained."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{flag} {directory}: a tokenizer without tokenizer.json is read with transformers' "
                          "AutoTokenizer: pip install transformers") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{flag} {directory}: transformers' AutoTokenizer cannot read its tokenizer files "
                         f"({type(exc).__name__}: {str(exc).strip()[:300]})") from None
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ValueError(f"{flag} {directory}: AutoTokenizer gave {type(tokenizer).__name__}, which has no fast "
                         "(tokenizers) backend; save the tokenizer with tokenizer.json")
    return tokenizer.backend_tokenizer


def _tokenizer_json(path: str):
    """A tokenizer.json of any model (load_tokenizer reads BERT's and checks BERT's special tokens)."""
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises plain Exception for a file it cannot parse
        raise ValueError(f"{path}: not a valid tokenizer.json ({exc}); the file is damaged or of another kind") \
            from None


def tokenizer_for(model_dir: str, path: str | None = None, lowercase: bool | None = None,
                  model_type: str = "bert"):
    """The tokenizer of a checkpoint, a `tokenizers.Tokenizer`. Padding and truncation are switched off
    (packing is done here).

    BERT (model_type "bert"): `path` (tokenizer.json or vocab.txt, or a tokenizer directory, read as the model
    directory is) when given, else the model directory's tokenizer.json, else its vocab.txt; lowercase (vocab.txt
    only) defaults to tokenizer_config.json's do_lower_case, else True. The family (RoBERTa, XLM-R, CamemBERT,
    ELECTRA, DistilBERT, MPNet): `path` (a tokenizer.json or a tokenizer directory) when given, else the model
    directory's tokenizer.json, else what transformers' AutoTokenizer reads there (vocab.json + merges.txt,
    sentencepiece.bpe.model, ...). ValueError when there is none."""
    if model_type != "bert":
        tokenizer = _family_tokenizer(model_dir, path, model_type)
    else:
        tokenizer = _bert_tokenizer(model_dir, path, lowercase)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _family_tokenizer(model_dir: str, path: str | None, model_type: str):
    if path is not None:
        if os.path.isdir(path):
            return _auto_tokenizer(path, "--tokenizer")
        if not path.endswith(".json"):
            raise ValueError(f"--tokenizer {path}: a {model_type} model takes a tokenizer.json or a tokenizer "
                             "directory (AutoTokenizer's files with tokenizer_config.json), not a bare vocabulary")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer {path} does not exist")
        return _tokenizer_json(path)
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return _tokenizer_json(os.path.join(model_dir, "tokenizer.json"))
    if any(os.path.isfile(os.path.join(model_dir, name)) for name in VOCABULARY_FILES):
        return _auto_tokenizer(model_dir, "--model")
    raise ValueError(f"--model {model_dir} has no tokenizer files (tokenizer.json, {', '.join(VOCABULARY_FILES)}); "
                     "pass --tokenizer")


def _bert_tokenizer(model_dir: str, path: str | None, lowercase: bool | None):
    flag = "--model"
    if path is not None and os.path.isdir(path):  # a tokenizer directory: read as a model directory's tokenizer is
        model_dir, path, flag = path, None, "--tokenizer"
    if path is None:
        for name in ("tokenizer.json", "vocab.txt"):
            if os.path.isfile(os.path.join(model_dir, name)):
                path = os.path.join(model_dir, name)
                break
        else:
            raise ValueError(f"{flag} {model_dir} has no tokenizer.json or vocab.txt"
                             + ("; pass --tokenizer (fastbert prepare-data writes both into its output directory)"
                                if flag == "--model" else ""))
        # the directory's vocab.txt beside transformers' settings (strip_accents, tokenize_chinese_chars) or added
        # tokens: read as transformers' AutoTokenizer reads them, where it is installed
        if (lowercase is None and path.endswith("vocab.txt") and importlib.util.find_spec("transformers") is not None
                and any(os.path.isfile(os.path.join(model_dir, name)) for name in BERT_TOKENIZER_SETTINGS)):
            # a tokenizer directory may have no config.json to name the model type to AutoTokenizer: BERT's here
            bert = {} if os.path.isfile(os.path.join(model_dir, "config.json")) else {"tokenizer_type": "bert"}
            tokenizer = _auto_tokenizer(model_dir, flag, **bert)
            check_special_tokens(tokenizer, path)
            return tokenizer
    if lowercase is None:
        lowercase = True
        config = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                lowercase = bool(json.load(f).get("do_lower_case", True))
    return load_tokenizer(path, lowercase)


def save_tokenizer_files(tokenizer, model_dir: str, out: str, model_type: str = "bert",
                         settings: dict | None = None) -> None:
    """The tokenizer into out (BERT's: tokenizer.json and vocab.txt; the family's: tokenizer.json) with the
    source directory's tokenizer_config.json (`settings` written into it) and special_tokens_map.json, so that
    transformers' AutoTokenizer loads the same tokenizer from out. BERT's do_lower_case is the tokenizer's own:
    transformers' BERT tokenizer lower-cases by it whatever tokenizer.json says (a --cased run on a model whose
    tokenizer_config.json said true was read back lower-casing)."""
    if model_type == "bert":
        save_tokenizer(tokenizer, out)
        settings = {"do_lower_case": lowercases(tokenizer), **(settings or {})}
    else:  # a byte-level or SentencePiece vocabulary has no vocab.txt form
        tokenizer.save(os.path.join(out, "tokenizer.json"))
    for name in TOKENIZER_SIDE_FILES:
        source = os.path.join(model_dir, name)
        if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(os.path.join(out, name)):
            shutil.copyfile(source, os.path.join(out, name))
    if settings:
        config = os.path.join(out, "tokenizer_config.json")
        values = {}
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                values = json.load(f)
        with open(config, "w", encoding="utf-8") as f:
            json.dump({**values, **settings}, f, indent=2)


def read_template(tokenizer, pair: bool) -> list[tuple[int | None, int, int]]:
    """The tokenizer's post-processor layout, one (token id, segment, token type) per part: a special token
    (its id; segment -1) or the place of segment 0 (A) or 1 (B) (token id None). Read by post-processing
    a probe text, so it is whatever template the tokenizer ships (BertProcessing, RobertaProcessing,
    TemplateProcessing). ValueError when the tokenizer adds no special token (no post-processor)."""
    probes = [tokenizer.encode(PROBE_TEXT, add_special_tokens=False) for _ in range(2 if pair else 1)]
    if not probes[0].ids:
        raise ValueError(f"the tokenizer turns {PROBE_TEXT!r} into no tokens, so its template cannot be read")
    length = len(probes[0].ids)
    processed = tokenizer.post_process(probes[0], probes[1] if pair else None, add_special_tokens=True)
    parts: list[tuple[int | None, int, int]] = []
    seen = 0  # probe tokens so far: the first `length` are segment A's, the others B's
    # special_tokens_mask, not sequence_ids: tokenizers leaves A's sequence ids unset in a pair
    for token, special, type_id in zip(processed.ids, processed.special_tokens_mask, processed.type_ids):
        if special:
            parts.append((token, -1, type_id))
            continue
        segment = int(seen >= length)
        if not parts or parts[-1][0] is not None or parts[-1][1] != segment:  # one part per segment
            parts.append((None, segment, type_id))
        seen += 1
    if all(token is None for token, _, _ in parts):
        raise ValueError("the tokenizer adds no special tokens (its tokenizer.json has no post_processor), so the "
                         "model's [CLS] / <s> and separators are unknown; use the tokenizer the checkpoint ships")
    return parts


class Packer:
    """Token ids -> model inputs of at most max_seq_length tokens, laid out by the tokenizer's template.
    token_types: whether the model takes token_type_ids (False for RoBERTa's single type, DistilBERT, MPNet)."""

    def __init__(self, tokenizer, max_seq_length: int, token_types: bool = True):
        self.single, self.pair = read_template(tokenizer, False), read_template(tokenizer, True)
        pads = [tokenizer.token_to_id(name) for name in PAD_TOKENS if tokenizer.token_to_id(name) is not None]
        if not pads:
            raise ValueError(f"the tokenizer has no padding token (one of {', '.join(PAD_TOKENS)})")
        minimum = self.special_tokens(pair=True) + 1
        if max_seq_length < minimum:
            raise ValueError(f"--max-seq-length must be at least {minimum} (a pair's {minimum - 1} special tokens "
                             f"and one token of text), got {max_seq_length}")
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.pad_id = pads[0]
        self.token_types = token_types

    def special_tokens(self, pair: bool) -> int:
        return sum(token is not None for token, _, _ in (self.pair if pair else self.single))

    def start(self, segment: int, length_a: int = 0, pair: bool = False) -> int:
        """Position of the segment's first token in a packed sequence whose segment A has length_a tokens."""
        position = 0
        for token, part_segment, _ in self.pair if pair else self.single:
            if token is None and part_segment == segment:
                return position
            position += 1 if token is not None else length_a
        raise ValueError(f"the tokenizer's {'pair' if pair else 'single'} template has no segment {segment}")

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pack(self, a: list[int], b: list[int] | None = None) -> dict[str, list[int]]:
        """The template around a (and b), truncated longest-first to max_seq_length."""
        budget = self.max_seq_length - self.special_tokens(b is not None)
        keep_a, keep_b = len(a), 0 if b is None else len(b)
        while keep_a + keep_b > budget:
            if keep_a > keep_b:
                keep_a -= 1
            else:
                keep_b -= 1
        segments = (a[:keep_a], [] if b is None else b[:keep_b])
        input_ids: list[int] = []
        token_type_ids: list[int] = []
        for token, segment, type_id in self.single if b is None else self.pair:
            piece = [token] if token is not None else segments[segment]
            input_ids += piece
            token_type_ids += [type_id] * len(piece)
        if not self.token_types:
            return {"input_ids": input_ids}
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
    """Model inputs padded to the batch's longest sequence: input_ids with the padding token, attention_mask
    1/0, token_type_ids (where the features have them) with 0, token labels with -100; scalar labels and
    positions stacked."""
    batch = {"input_ids": _pad([f["input_ids"] for f in features], pad_id)}
    batch["attention_mask"] = _pad([_ones(f["input_ids"]) for f in features], 0)
    if "token_type_ids" in features[0]:
        batch["token_type_ids"] = _pad([f["token_type_ids"] for f in features], 0)
    for key in features[0].keys() - {"input_ids", "token_type_ids"}:
        values = [f[key] for f in features]
        batch[key] = _pad(values, IGNORE_INDEX) if isinstance(values[0], list) else torch.tensor(values)
    return batch


def _ones(ids: list) -> list:
    return [_ones(s) for s in ids] if ids and isinstance(ids[0], list) else [1] * len(ids)
