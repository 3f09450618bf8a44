"""The WordPiece tokenizer: trained on the corpus with HF `tokenizers`, or read from a given
tokenizer.json or vocab.txt. `tokenizers` is imported only here, and only when a tokenizer is
built; training reads the vocabulary from vocab.txt and needs no tokenizer library.

A trained tokenizer is BERT's: BERT normaliser (lower-casing and accent stripping unless cased),
BERT pre-tokeniser (white space and punctuation), WordPiece with "##" continuation pieces, and the
special tokens [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4.
"""
from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable

from fastbert.files import write_text

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
    """A BERT WordPiece tokenizer (tokenizers.Tokenizer) trained on sentences, an iterable read twice
    (a list, or an object whose __iter__ starts over). The same sentences give the same vocabulary.

    Why twice: HF tokenizers' trainer numbers the "##x" continuation pieces in the order it meets them
    in a hash map of the words, which differs from run to run, and breaks ties between equally frequent
    merges by those numbers: four trainings on one corpus gave four vocabularies (huggingface/tokenizers
    issue 1794). The first pass finds the characters; declaring "##x" for each of them up front, in
    sorted order, numbers them before training, so every tie breaks the same way. They are declared as
    special tokens only to fix their ids, then made ordinary vocabulary entries again.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be larger than the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tk = _tokenizers()
    normalizer = tk.normalizers.BertNormalizer(lowercase=lowercase)  # accents stripped iff lowercase
    characters: set[str] = set()
    for sentence in sentences:
        characters.update(sentence)
    continuations = [CONTINUATION_PREFIX + c for c in continuation_characters(characters, normalizer)]
    trainer = tk.trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                           special_tokens=list(SPECIAL_TOKENS) + continuations,
                                           continuing_subword_prefix=CONTINUATION_PREFIX, show_progress=False)
    trained = _bert_tokenizer(tk.models.WordPiece(unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX),
                              normalizer)
    trained.train_from_iterator(iter(sentences), trainer)
    model = tk.models.WordPiece(trained.get_vocab(with_added_tokens=False), unk_token="[UNK]",
                                continuing_subword_prefix=CONTINUATION_PREFIX)
    tokenizer = _bert_tokenizer(model, normalizer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    _add_post_processor(tokenizer)
    return tokenizer


def _bert_tokenizer(model, normalizer):
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(model)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tk.decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    return tokenizer


def _is_punctuation(character: str) -> bool:
    """BERT's punctuation (ASCII symbols and Unicode P*): the pre-tokeniser makes each one a word of its own."""
    code = ord(character)
    return 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126 or \
        unicodedata.category(character).startswith("P")


def continuation_characters(characters: set[str], normalizer) -> list[str]:
    """Sorted characters that can follow another inside a word after BERT's normalisation: not white
    space, not punctuation, not CJK ideographs (the normaliser puts spaces around those)."""
    kept = set()
    for character in characters:
        normalized = normalizer.normalize_str(character)
        if normalized[:1].isspace():  # white space, or an ideograph the normaliser isolates
            continue
        kept.update(c for c in normalized if not c.isspace() and not _is_punctuation(c))
    return sorted(kept)


def _add_post_processor(tokenizer) -> None:
    """[CLS] A [SEP] B [SEP] with token types 0/1 when the tokenizer is used on pairs (as HF's BERT)."""
    tk = _tokenizers()
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])


def load_tokenizer(path: str, lowercase: bool = True):
    """A tokenizers.Tokenizer from a tokenizer.json, or from a BERT vocab.txt (one token per line)."""
    if os.path.isdir(path):  # a model's or a prepare-data output's: name the file in it that would be read
        inside = [os.path.join(path, name) for name in ("tokenizer.json", "vocab.txt")
                  if os.path.isfile(os.path.join(path, name))]
        raise ValueError(f"tokenizer file {path!r} is a directory; give a tokenizer.json or vocab.txt file"
                         + (f", such as {inside[0]}" if inside else ""))
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
    check_special_tokens(tokenizer, path)
    return tokenizer


def lowercases(tokenizer) -> bool:
    """Whether the tokenizer's normaliser lower-cases (a tokenizer.json may have none, or a sequence of them)."""
    return tokenizer.normalizer is not None and tokenizer.normalizer.normalize_str("A") == "a"


def check_special_tokens(tokenizer, path: str) -> None:
    """ValueError naming `path` when the tokenizer lacks one of BERT's special tokens."""
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer {path!r} lacks the special tokens {missing} that BERT pretraining needs")


def vocabulary(tokenizer) -> list[str]:
    """Tokens in id order (ids are dense from 0)."""
    by_id = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("tokenizer ids are not dense from 0; BERT needs one embedding row per id")
    return [by_id[i] for i in range(len(by_id))]


def save_tokenizer(tokenizer, directory: str) -> None:
    """tokenizer.json (for `tokenizers` / transformers) and vocab.txt (BERT's format) into directory,
    each replaced atomically."""
    os.makedirs(directory, exist_ok=True)
    write_text(os.path.join(directory, "tokenizer.json"), tokenizer.to_str(pretty=True))
    write_vocab(vocabulary(tokenizer), os.path.join(directory, "vocab.txt"))


def write_vocab(tokens: list[str], path: str) -> None:
    write_text(path, "".join(t + "\n" for t in tokens))


def read_vocab(path: str) -> list[str]:
    """vocab.txt's tokens in id order."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]
