"""The WordPiece tokenizer: trained on the corpus with HF `tokenizers`, or read from a given
tokenizer.json or vocab.txt. `tokenizers` is imported only here, and only when a tokenizer is
built; training reads the vocabulary from vocab.txt and needs no tokenizer library.

A trained tokenizer is BERT's: BERT normaliser (lower-casing and accent stripping unless cased),
BERT pre-tokeniser (white space and punctuation), WordPiece with "##" continuation pieces, and the
special tokens [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CONTINUATION_PREFIX = "##"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError("building a WordPiece tokenizer needs HF tokenizers: pip install tokenizers") from exc
    return tokenizers


def train_wordpiece(sentences: Iterable[str], vocab_size: int, lowercase: bool = True,
                    min_frequency: int = 2):
    """A BERT WordPiece tokenizer (tokenizers.Tokenizer) trained on an iterable of sentences."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be larger than the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX))
    tokenizer.normalizer = tk.normalizers.BertNormalizer(lowercase=lowercase)  # accents stripped iff lowercase
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tk.decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    trainer = tk.trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                           special_tokens=list(SPECIAL_TOKENS),
                                           continuing_subword_prefix=CONTINUATION_PREFIX, show_progress=False)
    tokenizer.train_from_iterator(sentences, trainer)
    _add_post_processor(tokenizer)
    return tokenizer


def _add_post_processor(tokenizer) -> None:
    """[CLS] A [SEP] B [SEP] with token types 0/1 when the tokenizer is used on pairs (as HF's BERT)."""
    tk = _tokenizers()
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])


def load_tokenizer(path: str, lowercase: bool = True):
    """A tokenizers.Tokenizer from a tokenizer.json, or from a BERT vocab.txt (one token per line)."""
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    tk = _tokenizers()
    try:
        if path.endswith(".json"):
            tokenizer = tk.Tokenizer.from_file(path)
        else:
            tokenizer = tk.BertWordPieceTokenizer(path, lowercase=lowercase)._tokenizer
    except Exception as exc:  # tokenizers raises plain Exception for a file it cannot parse
        kind = "tokenizer.json" if path.endswith(".json") else "vocab.txt (one token per line, UTF-8)"
        raise ValueError(f"{path}: not a valid {kind} ({exc}); the file is damaged or of another kind") from None
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer {path!r} lacks the special tokens {missing} that BERT pretraining needs")
    return tokenizer


def vocabulary(tokenizer) -> list[str]:
    """Tokens in id order (ids are dense from 0)."""
    by_id = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("tokenizer ids are not dense from 0; BERT needs one embedding row per id")
    return [by_id[i] for i in range(len(by_id))]


def save_tokenizer(tokenizer, directory: str) -> None:
    """tokenizer.json (for `tokenizers` / transformers) and vocab.txt (BERT's format) into directory."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    write_vocab(vocabulary(tokenizer), os.path.join(directory, "vocab.txt"))


def write_vocab(tokens: list[str], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(t + "\n" for t in tokens)


def read_vocab(path: str) -> list[str]:
    """vocab.txt's tokens in id order."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]
