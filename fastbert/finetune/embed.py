"""`fastbert embed`: the paper's feature-based approach (section 5.3): contextual embeddings from a
frozen BERT or one of the family (RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, MPNet: fastbert's
base model of the checkpoint's model_type, with the tokenizer the checkpoint ships), written to a .npy file.

    fastbert embed --model DIR --input sentences.txt --out features.npy

Input: a text file with one sequence per line (" ||| " separates a sentence pair, as in the paper's
extract_features.py), or a CSV / TSV / JSONL table read with --text-column / --text-pair-column.
Features: the hidden states of --layers (0 = the embeddings, -1 = the last layer; default the last
four, which the paper found best) joined by --combine (concatenated by default, or summed / averaged),
or --pooled for the pooler's tanh([CLS]) output. Per token: an array [N, S, D], zero past each
sequence's end, with the tokens of each sequence in OUT's stem + ".tokens.jsonl"; per sequence
(--per sequence): [N, D], the mean over each sequence's tokens (the special tokens, [CLS] and [SEP] or
<s> and </s>, included) or its first token's vector (--sequence-pool cls).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

import numpy as np
import torch

from fastbert.captured import CapturedForward, length_buckets
from fastbert.command import run_command
from fastbert.files import check_output_parent, output_lock, preallocate, replaced_files
from fastbert.finetune.encoding import Packer, collate, tokenizer_for
from fastbert.finetune.loading import checkpoint_directory, load_checkpoint, load_config, resolve_device
from fastbert.finetune.readers import TABLE_FORMATS, DataError, read_table, read_text

PAIR_SEPARATOR = " ||| "
logger = logging.getLogger("fastbert.embed")


def read_texts(path: str, text_column: str | None = None, text_pair_column: str | None = None,
               fmt: str | None = None) -> list[tuple[str, str | None]]:
    """(text, text pair or None) per sequence. A .txt file has one per line; a table is read by column."""
    if fmt is not None or os.path.splitext(path)[1].lower() in (".csv", ".tsv", ".jsonl", ".json"):
        columns = [text_column or "sentence"] + ([text_pair_column] if text_pair_column else [])
        return [(v[columns[0]], v.get(text_pair_column)) for _, v in read_table(path, columns, fmt)]
    texts = []
    lines = read_text(path).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise DataError(path, number, "empty line (one sequence per line; blank lines are not sequences)")
        a, sep, b = line.rstrip("\r").partition(PAIR_SEPARATOR)
        texts.append((a, b if sep else None))
    if not texts:
        raise DataError(path, None, "no sequences (the file is empty)")
    return texts


def check_layers(layers: list[int], num_hidden_layers: int) -> list[int]:
    """Layer indices into hidden_states (0 = embeddings, 1..L = the layers, negative from the end)."""
    count = num_hidden_layers + 1
    for layer in layers:
        if not -count <= layer < count:
            raise ValueError(f"layer {layer} is outside the model's hidden states: 0 (embeddings) to "
                             f"{num_hidden_layers}, or -1 to -{count}")
    return [layer % count for layer in layers]


@torch.no_grad()
def embed(model, packer: Packer, texts: list[tuple[str, str | None]], layers=(-4, -3, -2, -1),
          combine: str = "concat", pooled: bool = False, per: str = "token", sequence_pool: str = "mean",
          batch_size: int = 32, out: str | None = None, progress: bool = True) -> tuple[np.ndarray, list[list[str]]]:
    """Features of each sequence and its WordPiece tokens.

    Returns (features, tokens): features float32 [N, S, D] (per token, zero-padded to the longest
    sequence S) or [N, D] (per sequence, or pooled); D = H * len(layers) for concat, H otherwise.
    With `out` the features are written batch by batch into a .npy file beside it (memory-mapped, so
    per-token features of a large input never sit in memory whole), and per token the tokens into
    tokens_path(out), both renamed into place when complete (an interrupted run leaves the previous files,
    never one with unwritten rows of zeros, nor features beside another run's tokens); the returned
    array is the mapping. The file's blocks are reserved before the first row is written. A tqdm bar shows
    sequences per second (`progress`, on a terminal). The forward runs through fastbert.captured.CapturedForward:
    batches padded to `batch_size` rows and to a power-of-two length bucket, on a GPU as replayed CUDA graphs
    (one per bucket).
    Raises ValueError for unknown options or layers outside the model, fastbert.files.WriteError (an
    OSError) when `out` does not fit on its disk: naming it and the bytes it needs, the partial file removed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if combine not in ("concat", "sum", "mean"):
        raise ValueError(f"combine must be concat, sum or mean, got {combine!r}")
    if per not in ("token", "sequence"):
        raise ValueError(f"per must be token or sequence, got {per!r}")
    if sequence_pool not in ("mean", "cls"):
        raise ValueError(f"sequence_pool must be mean or cls, got {sequence_pool!r}")
    if pooled and getattr(model, "pooler", None) is None:  # DistilBERT has none at all
        raise ValueError("the model has no pooler, so there is no pooled output")
    layers = check_layers(list(layers), model.config.num_hidden_layers)
    a_ids = packer.tokenize([a for a, _ in texts])
    pair_ids = iter(packer.tokenize([b for _, b in texts if b is not None]))
    b_ids = [None if b is None else next(pair_ids) for _, b in texts]
    features = [packer.pack(a, b) for a, b in zip(a_ids, b_ids)]
    tokens = [[packer.tokenizer.id_to_token(i) for i in f["input_ids"]] for f in features]

    hidden_size = model.config.hidden_size
    width = hidden_size * len(layers) if combine == "concat" and not pooled else hidden_size
    shape = (len(features), width) if pooled or per == "sequence" else (len(features), max(map(len, tokens)), width)
    from tqdm import tqdm

    device = model.device
    model.eval()
    # on a GPU one CUDA graph per (batch size, length bucket), replayed; on CPU the same shapes run eagerly
    forward = CapturedForward(model, batch_sizes=(batch_size,), length_buckets=length_buckets(max(map(len, tokens))),
                              output_hidden_states=not pooled)
    outputs = ([out, tokens_path(out)] if len(shape) == 3 else [out]) if out else []
    written = replaced_files(outputs, 4 * int(np.prod(shape)), name=out) if out else contextlib.nullcontext()
    with written as partials, tqdm(total=len(features), unit="seq", desc="embedding",
                                   disable=None if progress else True) as bar:
        if out:
            result = np.lib.format.open_memmap(partials[0], mode="w+", dtype=np.float32, shape=shape)
            preallocate(partials[0])  # a full disk is an ENOSPC now, not a SIGBUS when a row lands in a hole
        else:
            result = np.zeros(shape, dtype=np.float32)
        for start in range(0, len(features), batch_size):
            batch = {k: v.to(device, non_blocking=True)
                     for k, v in collate(features[start:start + batch_size], packer.pad_id).items()}
            output = forward(**batch)
            rows = slice(start, start + len(batch["input_ids"]))
            bar.update(len(batch["input_ids"]))
            if pooled:
                result[rows] = output.pooler_output.float().cpu().numpy()
                continue
            mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)  # [B, S, 1]
            states = [output.hidden_states[layer].float() for layer in layers]  # each [B, S, H]
            if combine == "concat":
                hidden = torch.cat(states, dim=-1)
            else:
                hidden = torch.stack(states).sum(0) / (len(states) if combine == "mean" else 1)
            hidden = hidden * mask  # padded positions are zeros
            if per == "sequence":
                result[rows] = (hidden[:, 0] if sequence_pool == "cls" else hidden.sum(1) / mask.sum(1)).cpu().numpy()
            else:
                result[rows, :hidden.shape[1]] = hidden.cpu().numpy()
        if out:
            result.flush()
        if len(outputs) == 2:
            with open(partials[1], "w", encoding="utf-8") as f:
                f.writelines(json.dumps(t) + "\n" for t in tokens)
    return result, tokens


def tokens_path(out: str) -> str:
    """Where the tokens of per-token features written to `out` go: its stem + .tokens.jsonl."""
    return os.path.splitext(out)[0] + ".tokens.jsonl"


def _same_file(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastbert embed", description=__doc__.split("\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory or hub id of BERT, RoBERTa, XLM-RoBERTa, CamemBERT, "
                                                 "ELECTRA, DistilBERT or MPNet")
    p.add_argument("--input", required=True, help="text file, one sequence per line (' ||| ' for pairs), or a table")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--tokenizer", help="tokenizer.json, vocab.txt (BERT) or a tokenizer directory "
                                       "(default: the model directory's)")
    p.add_argument("--cased", dest="lowercase", action="store_const", const=False, default=None,
                   help="keep case when reading a vocab.txt")
    p.add_argument("--format", choices=TABLE_FORMATS, help="read --input as this table format")
    p.add_argument("--text-column", help="table input: the text column (default: sentence)")
    p.add_argument("--text-pair-column", help="table input: the second segment's column")
    p.add_argument("--layers", default="-4,-3,-2,-1",
                   help="comma-separated hidden-state indices: 0 = embeddings, -1 = last layer "
                        "(write --layers=-2,-1: a value starting with - needs the =)")
    p.add_argument("--combine", choices=("concat", "sum", "mean"), default="concat", help="how the layers join")
    p.add_argument("--pooled", action="store_true",
                   help="the pooler output (tanh of the first token) instead of layers")
    p.add_argument("--per", choices=("token", "sequence"), default="token")
    p.add_argument("--sequence-pool", choices=("mean", "cls"), default="mean",
                   help="with --per sequence: the mean of the tokens, or the first token ([CLS], <s>)")
    p.add_argument("--max-seq-length", type=int,
                   help="longer sequences are truncated (default: 128, or the model's positions if fewer)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--backend", choices=("auto", "triton", "torch"), help="default: the checkpoint's config")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_command("embed", lambda: run(args))


def run(args: argparse.Namespace) -> None:
    """Check every option, then embed into args.out (and its .tokens.jsonl) under the output's lock."""
    from fastbert import architectures, ops

    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    if not layers and not args.pooled:
        raise ValueError(f"--layers names no layer, got {args.layers!r}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a directory; --out names the .npy file to write")
    check_output_parent(args.out)
    # the features replace what is at --out, and the tokens (or, per sequence, the removal of a stale tokens file)
    # what is beside it: never the input
    if _same_file(args.out, args.input):
        raise ValueError(f"--out {args.out} is the --input file {args.input}: the features would replace it; "
                         "choose another --out")
    if _same_file(tokens_path(args.out), args.input):
        raise ValueError(f"--out {args.out} puts its tokens in {tokens_path(args.out)} (a per-sequence run removes "
                         f"that file), which is the --input file {args.input}; choose another --out")
    device = resolve_device(args.device)
    args.model = checkpoint_directory(args.model)
    config = load_config(args.model)
    ops.check_backend(args.backend or config.backend, device)
    tokenizer = tokenizer_for(args.model, args.tokenizer, args.lowercase, config.model_type)
    positions = config.max_sequence_length  # RoBERTa's 514 positions hold 512 tokens
    max_seq_length = min(128, positions) if args.max_seq_length is None else args.max_seq_length
    if max_seq_length > positions:
        raise ValueError(f"--max-seq-length {max_seq_length} is longer than the model's {positions} positions "
                         f"(max_position_embeddings {config.max_position_embeddings})")
    # its template sets the shortest --max-seq-length (a pair's special tokens and one of text): checked now
    packer = Packer(tokenizer, max_seq_length, token_types=config.type_vocab_size > 1)
    texts = read_texts(args.input, args.text_column, args.text_pair_column, args.format)
    model, info = load_checkpoint(architectures.model_class(config, "Model"), args.model, dtype=torch.float32,
                                  **({"backend": args.backend} if args.backend else {}))
    if args.pooled and any(k.startswith("pooler.") for k in info["missing_keys"]):
        raise ValueError(f"--pooled: the checkpoint {args.model} has no pooler weights")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with output_lock(args.out):
        features, tokens = embed(model.to(device), packer, texts, layers, args.combine, args.pooled,
                                 args.per, args.sequence_pool, args.batch_size, out=args.out)
        if features.ndim == 2 and os.path.exists(tokens_path(args.out)):  # a per-token run's: not these features'
            os.remove(tokens_path(args.out))
    truncated = sum(len(t) == packer.max_seq_length for t in tokens)
    logger.info(f"{len(texts)} sequences -> {args.out} {tuple(features.shape)}"
                + (f"; {truncated} reached --max-seq-length and may be truncated" if truncated else ""))


if __name__ == "__main__":
    sys.exit(main())
