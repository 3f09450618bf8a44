"""`fastbert prepare-data`: corpus -> WordPiece tokenizer -> MLM + NSP examples -> memory-mapped shards.

    fastbert prepare-data --corpus wiki.txt books.jsonl --out data/ [--vocab-size 30522]
                          [--tokenizer vocab.txt] [--max-seq-length 128 512] [--workers 8]

writes data/tokenizer.json and data/vocab.txt, and one dataset directory per sequence length,
data/seq128/ and data/seq512/ (see fastbert.data.shards for the format), which `fastbert pretrain
--data data/` reads. Documents are processed in chunks of --docs-per-chunk documents, one shard per
chunk and sequence length; a random NSP segment comes from another document of the same chunk. The
output depends on the seed and the chunk size, never on the number of workers. A dataset directory
is built under a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import sys
from collections.abc import Iterator

from fastbert.data.corpus import ENCODING_ERRORS, STDLIB, CorpusError, check_paths, read_documents
from fastbert.data.examples import create_examples
from fastbert.data.shards import VOCAB_FILE, shard_name, write_index, write_shard
from fastbert.data.tokenizer import load_tokenizer, save_tokenizer, train_wordpiece, vocabulary, write_vocab


def dataset_dir(out: str, max_seq_length: int) -> str:
    return os.path.join(out, f"seq{max_seq_length}")


def chunks(documents: Iterator[list[str]], size: int) -> Iterator[list[list[str]]]:
    """Lists of `size` documents; a last chunk of a single document joins the one before it."""
    pending: list[list[str]] = []
    current: list[list[str]] = []
    for document in documents:
        current.append(document)
        if len(current) == size:
            if pending:
                yield pending
            pending, current = current, []
    if len(current) == 1 or not pending:
        pending += current
        current = []
    for chunk in (pending, current):
        if chunk:
            yield chunk


def _process_chunk(job: tuple) -> tuple[int, dict[int, dict], int]:
    """Tokenise one chunk and write its shard for every sequence length (runs in a worker)."""
    number, documents, tokenizer_json, tmp_dirs, params = job
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_str(tokenizer_json)
    sentences = [s for document in documents for s in document]
    ids = iter(e.ids for e in tokenizer.encode_batch(sentences, add_special_tokens=False))
    tokenized = [[s for s in (next(ids) for _ in document) if s] for document in documents]
    tokenized = [d for d in tokenized if d]
    entries = {}
    if len(tokenized) >= 2:
        for max_seq_length, directory in tmp_dirs.items():
            rng = random.Random(f"{params['seed']}-{number}-{max_seq_length}")
            examples = create_examples(tokenized, max_seq_length, params["short_seq_prob"], params["dupe_factor"],
                                       params["cls_id"], params["sep_id"], rng)
            entries[max_seq_length] = write_shard(directory, shard_name(number), examples, params["vocab_size"])
    return number, entries, len(tokenized)


def build_tokenizer(corpus: list[str], tokenizer_path: str | None, vocab_size: int, lowercase: bool,
                    encoding_errors: str):
    if tokenizer_path:
        return load_tokenizer(tokenizer_path, lowercase)
    sentences = (s for document in read_documents(corpus, encoding_errors) for s in document)
    return train_wordpiece(sentences, vocab_size, lowercase)


def prepare_dataset(corpus: list[str], out: str, tokenizer: str | None = None, vocab_size: int = 30522,
                    lowercase: bool = True, max_seq_lengths: tuple[int, ...] = (128, 512),
                    short_seq_prob: float = 0.1, dupe_factor: int = 1, seed: int = 12345,
                    docs_per_chunk: int = 10000, workers: int = 1, encoding_errors: str = "strict",
                    overwrite: bool = False, log=print) -> dict[int, str]:
    """Build the datasets; returns {max_seq_length: dataset directory}. Raises CorpusError / ValueError."""
    for name, value, low in (("dupe_factor", dupe_factor, 1), ("docs_per_chunk", docs_per_chunk, 2),
                             ("workers", workers, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    for length in max_seq_lengths:
        if not 5 <= length <= 65535:
            raise ValueError(f"max_seq_length must be in [5, 65535], got {length}")
    if encoding_errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {encoding_errors!r}")
    check_paths(corpus)
    finals = {length: dataset_dir(out, length) for length in max_seq_lengths}
    existing = [d for d in finals.values() if os.path.exists(d)]
    if existing and not overwrite:
        raise ValueError(f"{existing} already exist; pass --overwrite to replace them")

    log(f"tokenizer: {'reading ' + tokenizer if tokenizer else f'training WordPiece (vocab {vocab_size})'}")
    tok = build_tokenizer(corpus, tokenizer, vocab_size, lowercase, encoding_errors)
    vocab = vocabulary(tok)
    os.makedirs(out, exist_ok=True)
    save_tokenizer(tok, out)
    params = dict(seed=seed, short_seq_prob=short_seq_prob, dupe_factor=dupe_factor, vocab_size=len(vocab),
                  cls_id=tok.token_to_id("[CLS]"), sep_id=tok.token_to_id("[SEP]"))
    tmp_dirs = {length: os.path.join(out, f".tmp-seq{length}-{os.getpid()}") for length in max_seq_lengths}
    for directory in tmp_dirs.values():
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    tokenizer_json = tok.to_str()
    jobs = ((number, chunk, tokenizer_json, tmp_dirs, params)
            for number, chunk in enumerate(chunks(read_documents(corpus, encoding_errors), docs_per_chunk)))
    shards: dict[int, dict[int, dict]] = {}  # chunk number -> {max_seq_length: shard entry}
    documents = 0
    try:
        if workers == 1:
            for number, entries, count in map(_process_chunk, jobs):
                shards[number], documents = entries, documents + count
        else:  # spawn: the parent's tokenizer threads must not be forked
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for number, entries, count in pool.imap_unordered(_process_chunk, jobs):
                    shards[number], documents = entries, documents + count
        if documents < 2:
            raise CorpusError(f"the corpus has {documents} document(s) with text; next sentence prediction "
                              "needs at least 2 (separate documents by a blank line, or one per .jsonl line)")
        for length, directory in tmp_dirs.items():
            entries = [shards[number][length] for number in sorted(shards) if shards[number]]
            write_vocab(vocab, os.path.join(directory, VOCAB_FILE))
            special = {name: tok.token_to_id(f"[{name.upper()}]") for name in ("pad", "unk", "cls", "sep", "mask")}
            write_index(directory, {
                "max_seq_length": length, "vocab_size": len(vocab), "special_ids": special,
                "examples": sum(e["examples"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
                "documents": documents, "shards": entries,
                "options": {"corpus": [os.path.abspath(p) if p != STDLIB else p for p in corpus],
                            "seed": seed, "short_seq_prob": short_seq_prob, "dupe_factor": dupe_factor,
                            "docs_per_chunk": docs_per_chunk, "lowercase": lowercase}})
            if os.path.exists(finals[length]):
                shutil.rmtree(finals[length])
            os.replace(directory, finals[length])
            log(f"seq {length}: {sum(e['examples'] for e in entries)} examples from {documents} documents "
                f"in {len(entries)} shards -> {finals[length]}")
    finally:
        for directory in tmp_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
    return finals


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastbert prepare-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", nargs="+", required=True,
                        help="text files (one sentence per line, blank line between documents), .jsonl files "
                             '(a "text" field per document), or "stdlib" (Python\'s docstrings)')
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tokenizer", help="use this tokenizer.json or vocab.txt instead of training one")
    parser.add_argument("--vocab-size", type=int, default=30522, help="WordPiece vocabulary size when training")
    parser.add_argument("--cased", action="store_true", help="keep case and accents (default: lower-case)")
    parser.add_argument("--max-seq-length", type=int, nargs="+", default=[128, 512],
                        help="one dataset per length (the paper's two phases: 128 and 512)")
    parser.add_argument("--short-seq-prob", type=float, default=0.1, help="probability of a shorter target length")
    parser.add_argument("--dupe-factor", type=int, default=1,
                        help="passes over the corpus, each cutting the documents differently")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--docs-per-chunk", type=int, default=10000, help="documents per shard")
    parser.add_argument("--workers", type=int, default=1, help="processes building shards")
    parser.add_argument("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
                        help="what to do with bytes that are not UTF-8 (default: stop with the file and line)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing dataset directories")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prepare_dataset(args.corpus, args.out, args.tokenizer, args.vocab_size, not args.cased,
                        tuple(args.max_seq_length), args.short_seq_prob, args.dupe_factor, args.seed,
                        args.docs_per_chunk, args.workers, args.encoding_errors, args.overwrite)
    except (ValueError, ImportError) as exc:
        print(f"fastbert prepare-data: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
