"""`fastbert prepare-data`: corpus -> WordPiece tokenizer -> pretraining examples -> memory-mapped shards.

    fastbert prepare-data --corpus wiki.txt books.jsonl --out data/ [--vocab-size 30522]
                          [--tokenizer vocab.txt] [--max-seq-length 128 512] [--workers N]
                          [--objective mlm+nsp|mlm]

--objective mlm+nsp (the default, BERT's): [CLS] A [SEP] B [SEP] pairs with their next-sentence label.
--objective mlm (RoBERTa's FULL-SENTENCES, for `fastbert pretrain --objective mlm`): the sentences in
order, packed across document boundaries up to the length, a [SEP] between documents, one token type,
no NSP label. The objective is part of a dataset's identity: `fastbert pretrain` refuses a dataset
made for the other one.

writes data/tokenizer.json and data/vocab.txt, and one dataset directory per sequence length,
data/seq128/ and data/seq512/ (see fastbert.data.shards for the format), which `fastbert pretrain
--data data/` reads.

At corpus scale: the corpus is cut into chunks of about --chunk-bytes of text at document boundaries
(fastbert.data.corpus.plan_chunks); each chunk becomes one shard per sequence length, built by one of
--workers processes (default: every core this process may use), so a worker's memory is bounded by
the chunk size, not by the size of the corpus or of its documents; a random NSP segment comes from
another document of the same chunk (a chunk holding a single document, longer than a chunk, is cut
in two for that; --objective mlm packs each chunk's sentences, so an example never spans two chunks).
The vocabulary is trained on at most --vocab-sample-bytes of text, taken from the start of every chunk.
The output depends on the corpus, the chunk size, the seed and the other options, never on the number
of workers, and is the same byte for byte on every run.

Re-running: a directory has one tokenizer, which later runs reuse (another sequence length, a resumed
run); data/prepare-data.json, written with it, marks the directory as this command's and records the
vocabulary size asked for. An existing --out holding other files is refused: a user's vocab.txt is never
replaced, nor a stray tokenizer.json taken for the directory's. Shards are built in data/.partial-seqN/,
each finished one recorded there, so a run that was interrupted or killed continues where it stopped when
started again with the same options; the directory becomes data/seqN/ when complete. A dataset already
made with the same options is left as it is; one made with other options needs --overwrite. A lock
(fastbert.files.lock_path of data/prepare, in the user's cache) makes a second process wait for the
first: two `fastbert pretrain` runs share the built-in corpus's cache that way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from fastbert.command import run_command
from fastbert.data import sharding
from fastbert.data.corpus import ENCODING_ERRORS, STDLIB, CorpusError, Segment, plan_chunks, segment_documents
from fastbert.data.examples import MLM, MLM_NSP, OBJECTIVES
from fastbert.data.sharding import ShardParams, build_shards, marker_path
from fastbert.data.shards import VOCAB_FILE, read_index, write_index
from fastbert.data.tokenizer import (SPECIAL_TOKENS, load_tokenizer, lowercases, save_tokenizer, train_wordpiece,
                                     vocabulary, write_vocab)
from fastbert.files import (cache_dir, check_output_parent, move_into_place, output_lock, remove_leftovers, write_text,
                            writing)

logger = logging.getLogger("fastbert.data")
DEFAULT_VOCAB_SIZE = 30522
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_VOCAB_SAMPLE_BYTES = 1 << 30
PLAN_FILE = "plan.json"  # in a partial dataset directory: what its finished shards were built from
# in the output directory, written with its tokenizer: marks the directory as prepare-data's (its datasets may
# not exist yet) and records what the tokenizer was asked for, which a rerun compares its options with
TOKENIZER_RECORD = "prepare-data.json"


def dataset_dir(out: str, max_seq_length: int) -> str:
    return os.path.join(out, f"seq{max_seq_length}")


def partial_dir(out: str, max_seq_length: int) -> str:
    return os.path.join(out, f".partial-seq{max_seq_length}")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset may limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_bytes(text: str) -> int:
    """'64M' -> 67108864: K, M, G and T are powers of 1024; a plain number is bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 64M or 1G, got {text!r}")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# the tokenizer ------------------------------------------------------------------------------------------
class VocabularySample:
    """Sentences for vocabulary training: the first sample_bytes / chunks bytes (about) of every chunk, so
    the sample is spread over the corpus; iterating again reads it again (training reads it twice)."""

    def __init__(self, plan: list[list[Segment]], sample_bytes: int, encoding_errors: str):
        self.plan, self.per_chunk, self.encoding_errors = plan, sample_bytes // len(plan), encoding_errors

    def _chunk(self, segments: list[Segment]) -> Iterator[str]:
        budget = self.per_chunk
        for segment in segments:
            for document in segment_documents(segment, self.encoding_errors):
                for sentence in document:
                    yield sentence
                    budget -= len(sentence) + 1
                    if budget <= 0:
                        return

    def __iter__(self) -> Iterator[str]:
        for segments in self.plan:
            yield from self._chunk(segments)


def _ignored(tokenizer, size: int, vocab_size: int | None, lowercase: bool, asked: int | None = None) -> str:
    """The note naming the options that a tokenizer made elsewhere does not follow: only what the caller asked
    for and does not get, so a rerun with the same options hears nothing of them."""
    ignored = [f"--vocab-size {vocab_size}"] * (vocab_size not in (None, size, asked)) + \
        ["--cased"] * (lowercases(tokenizer) and not lowercase)
    return ", ".join(ignored)


def directory_tokenizer(out: str, tokenizer_path: str | None, vocab_size: int | None, lowercase: bool,
                        plan: list[list[Segment]], sample_bytes: int, encoding_errors: str):
    """The tokenizer of `out`: the one it holds (a directory has one, so that all its datasets share the
    ids), else --tokenizer's, else one trained on a sample of the corpus; saved into `out` when new."""
    existing = os.path.join(out, "tokenizer.json")
    if os.path.isfile(existing):
        tokenizer = load_tokenizer(existing)
        if tokenizer_path and load_tokenizer(tokenizer_path, lowercase).to_str() != tokenizer.to_str():
            raise ValueError(f"--tokenizer {tokenizer_path} differs from {existing}, which the datasets in {out} "
                             "use; one directory holds the datasets of one tokenizer: choose a new --out")
        size = len(vocabulary(tokenizer))
        try:  # the size asked for when it was trained: an identical rerun is not told that its option was ignored
            with open(os.path.join(out, TOKENIZER_RECORD), encoding="utf-8") as f:
                asked = json.load(f).get("vocab_size")
        except (OSError, ValueError, AttributeError):  # none (a directory from before the record), or damaged
            asked = None
        ignored = _ignored(tokenizer, size, vocab_size, lowercase, asked)
        note = f" (ignored here, for a new --out: {ignored})" if ignored else ""
        logger.info(f"tokenizer: {existing} ({size} tokens), as for this directory's other datasets{note}")
        return tokenizer
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path, lowercase)
        size = len(vocabulary(tokenizer))
        # a given tokenizer is used as it is: --vocab-size trains nothing, and a tokenizer.json keeps its own case
        ignored = _ignored(tokenizer, size, vocab_size, lowercase)
        note = f" (ignored with --tokenizer {tokenizer_path}: {ignored})" if ignored else ""
        logger.info(f"tokenizer: {tokenizer_path} ({size} tokens){note}")
        asked = None
    else:
        asked = vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        logger.info(f"tokenizer: training WordPiece (vocabulary {vocab_size}) on up to "
                    f"{sample_bytes / 2**20:.0f} MiB of the corpus")
        tokenizer = train_wordpiece(VocabularySample(plan, sample_bytes, encoding_errors), vocab_size, lowercase)
        size = len(vocabulary(tokenizer))
        if size < vocab_size:  # WordPiece stops when the text holds no more words and pieces to add
            logger.info(f"vocabulary: {size} tokens (fewer than --vocab-size {vocab_size}: the text it was trained "
                        "on has no more)")
    # the record first: a tokenizer.json without it would make the directory look like someone else's
    write_text(os.path.join(out, TOKENIZER_RECORD), json.dumps({"vocab_size": asked}) + "\n")
    save_tokenizer(tokenizer, out)
    return tokenizer


def is_prepared_directory(out: str) -> bool:
    """Whether `out` is a prepare-data output: its tokenizer record, a dataset (seqN/index.json) or a dataset
    being built (.partial-seqN/plan.json; a directory from before the record has one of those two)."""
    if os.path.isfile(os.path.join(out, TOKENIZER_RECORD)):
        return True
    for name in os.listdir(out):
        if re.fullmatch(r"seq\d+", name) and os.path.isfile(os.path.join(out, name, "index.json")) or \
                re.fullmatch(r"\.partial-seq\d+", name) and os.path.isfile(os.path.join(out, name, PLAN_FILE)):
            return True
    return False


def check_output_directory(out: str) -> None:
    """ValueError, before anything is written, for an --out that is a file or below one, or an existing
    directory holding other files than prepare-data's: its vocab.txt would be replaced, its tokenizer.json
    taken for the tokenizer of datasets that are not there."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; --out names the output directory")
    check_output_parent(out)
    if os.path.isdir(out) and os.listdir(out) and not is_prepared_directory(out):
        names = sorted(os.listdir(out))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(f"--out {out} holds files that `fastbert prepare-data` did not write ({shown}; no "
                         f"{TOKENIZER_RECORD} or seqN/ dataset): it writes its own tokenizer.json and vocab.txt "
                         "there; choose a new or empty --out (a tokenizer of yours: pass it with --tokenizer)")


# the command ----------------------------------------------------------------------------------------------
@dataclass
class PrepareOptions:
    corpus: list[str]  # text / .jsonl files, or "stdlib"
    out: str  # output directory
    tokenizer: str | None = None  # a tokenizer.json or vocab.txt to use instead of training one
    vocab_size: int | None = None  # WordPiece vocabulary to train; None: 30522
    lowercase: bool = True  # lower-case and strip accents (a trained tokenizer; a vocab.txt)
    max_seq_lengths: tuple[int, ...] = (128, 512)  # one dataset per length
    objective: str = MLM_NSP  # mlm+nsp: NSP pairs (BERT's) | mlm: full sentences packed across documents
    short_seq_prob: float = 0.1  # probability of a shorter target length (mlm+nsp)
    dupe_factor: int = 1  # passes over the corpus, each cutting the documents differently (mlm+nsp)
    seed: int = 12345
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # text per chunk (one shard per length): bounds a worker's memory
    workers: int | None = None  # processes building shards; None: every available core
    vocab_sample_bytes: int = DEFAULT_VOCAB_SAMPLE_BYTES  # text the vocabulary is trained on, at most
    encoding_errors: str = "strict"  # bytes that are not UTF-8: strict (an error) | replace | ignore
    overwrite: bool = False  # replace datasets that were made with other options

    def validate(self) -> None:
        # named by the flag the user typed (the Python API's keywords are the same words with underscores)
        for name, value, low in (("--dupe-factor", self.dupe_factor, 1), ("--chunk-bytes", self.chunk_bytes, 1024),
                                 ("--vocab-sample-bytes", self.vocab_sample_bytes, 1024)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.vocab_size is not None and self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"--vocab-size must be larger than the {len(SPECIAL_TOKENS)} special tokens, "
                             f"got {self.vocab_size}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        for length in self.max_seq_lengths:
            if not 5 <= length <= 65535:
                raise ValueError(f"--max-seq-length must be in [5, 65535], got {length}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.objective == MLM and self.dupe_factor != 1:
            raise ValueError(f"--dupe-factor must be 1 with --objective {MLM}, got {self.dupe_factor}: full "
                             "sentences are packed the same way every pass, and the masks are drawn anew every "
                             "epoch anyway")
        if self.encoding_errors not in ENCODING_ERRORS:
            raise ValueError(f"--encoding-errors must be one of {ENCODING_ERRORS}, got {self.encoding_errors!r}")

    def recorded(self, plan: list[list[Segment]]) -> dict:
        """What index.json records of the options that decide the data, and a rerun compares."""
        sizes: dict[str, int] = {}
        for segment in (s for chunk in plan for s in chunk):
            name = STDLIB if segment.kind == "python" else os.path.abspath(segment.path)
            sizes[name] = sizes.get(name, 0) + segment.end - segment.start
        recorded = {"corpus": [{"path": path, "bytes": size} for path, size in sizes.items()], "seed": self.seed,
                    "objective": self.objective, "short_seq_prob": self.short_seq_prob,
                    "dupe_factor": self.dupe_factor, "chunk_bytes": self.chunk_bytes,
                    "encoding_errors": self.encoding_errors}
        if self.objective == MLM:  # packing draws nothing and cuts no shorter examples: no rerun is told of them
            del recorded["seed"], recorded["short_seq_prob"]
        return recorded


def prepare_dataset(corpus: list[str], out: str, **options) -> dict[int, str]:
    """Build the datasets (PrepareOptions' fields as keywords; see the module docstring); returns
    {max_seq_length: dataset directory}. Raises CorpusError / ValueError for bad input, before anything
    is written, and OSError for a failed write (the datasets already there stay as they were)."""
    options = PrepareOptions(corpus, out, **options)
    options.validate()
    check_output_directory(out)
    plan = plan_chunks(options.corpus, options.chunk_bytes)
    # created: whether this run makes --out, known only under the lock (another run may make or remove it first)
    with output_lock(os.path.join(out, "prepare"), wait=True) as created:
        try:
            return _build(options, plan)
        except ValueError:  # bad input found while building (a corpus of one document, a tokenizer file that is not)
            if created:  # what this call began there (the tokenizer it trained) goes with it, under the lock: a
                # run that waited for it must not lose what it then writes there
                shutil.rmtree(out, ignore_errors=True)
            raise


def _build(options: PrepareOptions, plan: list[list[Segment]]) -> dict[int, str]:
    out = options.out
    tokenizer = directory_tokenizer(out, options.tokenizer, options.vocab_size, options.lowercase, plan,
                                    options.vocab_sample_bytes, options.encoding_errors)
    tokenizer_json = tokenizer.to_str()
    identity = {"options": options.recorded(plan), "tokenizer_sha256": sha256(tokenizer_json)}
    finals = {length: dataset_dir(out, length) for length in options.max_seq_lengths}
    todo = {length: partial_dir(out, length) for length, final in finals.items()
            if _needs_building(final, identity, options.overwrite)}
    if not todo:
        return finals
    plan_identity = {**identity, "plan_sha256": sha256(json.dumps([[asdict(s) for s in c] for c in plan]))}
    vocab = vocabulary(tokenizer)
    params = ShardParams(options.seed, options.short_seq_prob, options.dupe_factor, len(vocab),
                         tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"), options.encoding_errors,
                         options.objective)
    special = {name: tokenizer.token_to_id(f"[{name.upper()}]") for name in ("pad", "unk", "cls", "sep", "mask")}
    # a full disk: the finished shards stay in the partial directories for a rerun
    with writing(out, list(todo.values()), remove=False, kept="the datasets already there are unchanged; the "
                 "shards finished so far are kept for the same command to resume from"):
        for length, directory in todo.items():
            _open_partial(directory, {**plan_identity, "max_seq_length": length}, len(plan))
        jobs = [(number, chunk, {length: d for length, d in todo.items()
                                 if not os.path.isfile(marker_path(d, number))}) for number, chunk in enumerate(plan)]
        jobs = [job for job in jobs if job[2]]
        _run_jobs(jobs, plan, tokenizer_json, params, min(options.workers or available_cores(), max(len(jobs), 1)))
        for length, directory in todo.items():
            _finish(directory, finals[length], len(plan), {"max_seq_length": length, "vocab_size": len(vocab),
                                                            "special_ids": special, **identity}, vocab,
                    options.objective)
    return finals


def _needs_building(final: str, identity: dict, overwrite: bool) -> bool:
    """False for a complete dataset made with the same options and tokenizer; a different one is an error
    unless overwrite."""
    remove_leftovers(final)
    if not os.path.exists(final):
        return True
    try:
        metadata = read_index(final)
        # a dataset from before the objective was recorded was made for NSP
        then = {"objective": MLM_NSP, **metadata.get("options", {}),
                "tokenizer_sha256": metadata.get("tokenizer_sha256")}
        now = {**identity["options"], "tokenizer_sha256": identity["tokenizer_sha256"]}
        differences = [f"{key}: {then.get(key)!r} then, {value!r} now" for key, value in now.items()
                       if then.get(key) != value]
    except ValueError as exc:
        differences = [str(exc)]
    if not differences:
        logger.info(f"{final}: already prepared with these options and tokenizer")
        return False
    if not overwrite:
        raise ValueError(f"{final} exists and was prepared otherwise ({'; '.join(differences)}); "
                         "pass --overwrite to replace it")
    return True


def _open_partial(directory: str, identity: dict, chunks: int) -> None:
    """The partial directory of one dataset: kept when it was started with the same options, tokenizer
    and corpus (its finished shards are reused), started afresh otherwise."""
    plan_file = os.path.join(directory, PLAN_FILE)
    try:
        with open(plan_file, encoding="utf-8") as f:
            same = json.load(f) == identity
    except (OSError, ValueError):
        same = False
    if same:
        done = sum(os.path.isfile(marker_path(directory, n)) for n in range(chunks))
        logger.info(f"resuming {directory}: {done} of {chunks} shards were done")
        return
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    write_text(plan_file, json.dumps(identity) + "\n")


def _run_jobs(jobs: list, plan: list[list[Segment]], tokenizer_json: str, params: ShardParams, workers: int) -> None:
    """build_shards for every job, in `workers` processes (in this one for 1), with a progress bar in bytes."""
    from tqdm import tqdm

    total = sum(s.end - s.start for chunk in plan for s in chunk)
    todo = sum(s.end - s.start for _, chunk, _ in jobs for s in chunk)
    logger.info(f"building {len(jobs)} of {len(plan)} shards ({todo / 2**20:.1f} of {total / 2**20:.1f} MiB "
                f"of text) with {workers} worker(s)")
    with tqdm(total=total, initial=total - todo, unit="B", unit_scale=True, unit_divisor=1024,
              desc="prepare-data", disable=None) as bar:
        if workers == 1:
            sharding.start_worker(tokenizer_json, params, one_thread=False)
            try:
                for job in jobs:
                    bar.update(build_shards(job))
            finally:
                sharding.stop_worker()
            return
        # spawn, not fork: the parent's tokenizer threads must not be forked
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, sharding.start_worker, (tokenizer_json, params, True)) as pool:
            for size in pool.imap_unordered(build_shards, jobs):
                bar.update(size)


def _finish(directory: str, final: str, chunks: int, metadata: dict, vocab: list[str], objective: str) -> None:
    """index.json and vocab.txt into the partial directory, which then becomes the dataset."""
    entries = []
    for number in range(chunks):
        with open(marker_path(directory, number), encoding="utf-8") as f:
            entries.append(json.load(f))
    documents = sum(entry.pop("documents") for entry in entries)
    if documents < 2 and objective == MLM_NSP:
        shutil.rmtree(directory, ignore_errors=True)
        raise CorpusError(f"the corpus has {documents} document(s) with text; next sentence prediction "
                          "needs at least 2 (separate documents by a blank line, or one per .jsonl line)")
    write_vocab(vocab, os.path.join(directory, VOCAB_FILE))
    fingerprint = sha256(metadata["tokenizer_sha256"] + "".join(e["sha256"] for e in entries))
    examples = sum(e["examples"] for e in entries)
    write_index(directory, {**metadata, "examples": examples, "tokens": sum(e["tokens"] for e in entries),
                            "documents": documents, "fingerprint": fingerprint, "shards": entries})
    for number in range(chunks):
        os.remove(marker_path(directory, number))
    os.remove(os.path.join(directory, PLAN_FILE))
    move_into_place(directory, final)
    logger.info(f"seq {metadata['max_seq_length']}: {examples} examples from {documents} documents in {chunks} "
                f"shards -> {final}")


# the built-in corpus ------------------------------------------------------------------------------------
def builtin_dir(vocab_size: int, objective: str = MLM_NSP) -> str:
    """Where the built-in corpus with this vocabulary size is cached (per Python version: its docstrings)."""
    suffix = "-mlm" if objective == MLM else ""  # each objective its own entry: neither rebuilds the other's
    return os.path.join(cache_dir(),
                        f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-vocab{vocab_size}{suffix}")


def builtin_dataset(vocab_size: int, max_seq_lengths: Sequence[int], objective: str = MLM_NSP) -> str:
    """The built-in corpus (Python's docstrings) prepared once into the cache; returns its directory.
    Concurrent callers wait for the first and reuse what it wrote (the directory's lock); a cache entry
    that is damaged or was made by another version is rebuilt, never an error for good."""
    root = builtin_dir(vocab_size, objective)
    options = PrepareOptions([STDLIB], root, vocab_size=vocab_size, max_seq_lengths=tuple(max_seq_lengths),
                             objective=objective)
    options.validate()
    plan = plan_chunks(options.corpus, options.chunk_bytes)
    os.makedirs(root, exist_ok=True)
    with output_lock(os.path.join(root, "prepare"), wait=True):
        try:
            _build(options, plan)
        except CorpusError:
            raise
        except ValueError as exc:
            logger.warning(f"rebuilding the built-in corpus's cache {root}: {exc}")
            for name in os.listdir(root):
                path = os.path.join(root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            _build(options, plan)
    return root


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastbert prepare-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", nargs="+", required=True,
                        help="text files (one sentence per line, blank line between documents), .jsonl files "
                             '(a "text" field per document), or "stdlib" (Python\'s docstrings)')
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tokenizer", help="use this tokenizer.json or vocab.txt instead of training one")
    parser.add_argument("--vocab-size", type=int, help=f"WordPiece vocabulary size when training "
                                                       f"(default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--cased", action="store_true", help="keep case and accents (default: lower-case)")
    parser.add_argument("--max-seq-length", type=int, nargs="+", default=[128, 512],
                        help="one dataset per length (the paper's two phases: 128 and 512)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=MLM_NSP,
                        help="mlm+nsp (default, BERT's): [CLS] A [SEP] B [SEP] pairs for next sentence prediction; "
                             "mlm (RoBERTa's): full sentences in order, packed across documents up to the length "
                             "with a [SEP] between documents, for `fastbert pretrain --objective mlm`")
    parser.add_argument("--short-seq-prob", type=float, default=0.1,
                        help="probability of a shorter target length (mlm+nsp)")
    parser.add_argument("--dupe-factor", type=int, default=1,
                        help="passes over the corpus, each cutting the documents differently (mlm+nsp)")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--chunk-bytes", type=parse_bytes, default=DEFAULT_CHUNK_BYTES,
                        help="text per shard, e.g. 32M (the default); it bounds a worker's memory whatever the "
                             "corpus and document sizes (PERF.md has the measured peaks)")
    parser.add_argument("--workers", type=int,
                        help=f"processes building shards (default: the {available_cores()} available cores)")
    parser.add_argument("--vocab-sample-bytes", type=parse_bytes, default=DEFAULT_VOCAB_SAMPLE_BYTES,
                        help="train the vocabulary on at most this much text, spread over the corpus (default 1G)")
    parser.add_argument("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
                        help="what to do with bytes that are not UTF-8 (default: stop with the file and line)")
    parser.add_argument("--overwrite", action="store_true", help="replace datasets made with other options")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        prepare_dataset(args.corpus, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                        lowercase=not args.cased, max_seq_lengths=tuple(args.max_seq_length),
                        objective=args.objective, short_seq_prob=args.short_seq_prob,
                        dupe_factor=args.dupe_factor, seed=args.seed,
                        chunk_bytes=args.chunk_bytes, workers=args.workers,
                        vocab_sample_bytes=args.vocab_sample_bytes, encoding_errors=args.encoding_errors,
                        overwrite=args.overwrite)

    return run_command("prepare-data", run)


if __name__ == "__main__":
    sys.exit(main())
