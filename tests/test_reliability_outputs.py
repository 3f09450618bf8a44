"""Issue 14 outside the training loop: outputs that are complete or absent (finetune, embed, convert,
prepare-data, the built-in corpus cache), locked against a second writer, with the umask's permissions;
every bad input a message naming the file or argument, exit code 2, nothing destroyed.
docs/reliability.md lists each case with its test here."""
import ast
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import fastbert
from fastbert import cli
from fastbert.data import prepare as prepare_module
from fastbert.data.shards import ShardedDataset
from fastbert.data.tokenizer import SPECIAL_TOKENS
from fastbert.files import output_lock
from fastbert.finetune import FinetuneConfig, finetune
from fastbert.finetune import train as finetune_train
from fastbert.finetune.readers import DataError
from tests.test_data import write_corpus
from tests.full_disk import fill, run_fastbert, small_disk
from tests.test_finetune import FAST, FILLER, tiny_model, write_sentiment, write_squad  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def digest(directory):
    """{file name: sha256} of a directory (or a single file): what 'unchanged' means below."""
    if os.path.isfile(directory):
        with open(directory, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return {name: digest(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


def leftovers(folder):
    """Hidden files a run left behind: partial or old outputs, lock files (those live in the cache)."""
    return [n for n in os.listdir(folder) if n.startswith(".")]


def finetune_config(tmp_path, model, **changes):
    values = dict(train=str(tmp_path / "train.tsv"), eval=str(tmp_path / "train.tsv"), out=str(tmp_path / "out"),
                  max_steps=2, **FAST)
    return FinetuneConfig("classification", model, **{**values, **changes})


@pytest.fixture
def sentiment(tmp_path):
    write_sentiment(tmp_path / "train.tsv", 24, seed=1)


# finetune ---------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("sentiment")
def test_finetune_out_equal_to_or_holding_model_is_refused(tmp_path, tiny_model):
    before = digest(tiny_model)
    for out in (tiny_model, os.path.dirname(tiny_model)):
        with pytest.raises(ValueError, match="fine-tuning would replace the checkpoint it starts from"):
            finetune(finetune_config(tmp_path, tiny_model, out=out))
    assert digest(tiny_model) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="did not write"):
        finetune(finetune_config(tmp_path, tiny_model, out=str(tmp_path / "mine")))


@pytest.mark.usefixtures("sentiment")
def test_finetune_rerun_replaces_the_output_directory(tmp_path, tiny_model):
    finetune(finetune_config(tmp_path, tiny_model))
    assert (tmp_path / "out" / "predictions.jsonl").exists()
    finetune(finetune_config(tmp_path, tiny_model, eval=None))
    assert not (tmp_path / "out" / "predictions.jsonl").exists()  # it described the previous model
    assert json.loads((tmp_path / "out" / "eval_results.json").read_text())["best"] is None
    assert (tmp_path / "out" / "model.safetensors").exists() and not leftovers(tmp_path)


@pytest.mark.usefixtures("sentiment")
def test_finetune_interrupted_or_concurrent_leaves_the_previous_output(tmp_path, tiny_model, monkeypatch):
    finetune(finetune_config(tmp_path, tiny_model))
    before = digest(tmp_path / "out")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(finetune_train, "evaluate", interrupted)  # after the first epoch's training steps
        with pytest.raises(KeyboardInterrupt):
            finetune(finetune_config(tmp_path, tiny_model, seed=7))
    assert digest(tmp_path / "out") == before and not leftovers(tmp_path)
    with output_lock(str(tmp_path / "out")):  # another process is writing it
        with pytest.raises(OSError, match="being written by another fastbert process"):
            finetune(finetune_config(tmp_path, tiny_model, seed=7))
    assert digest(tmp_path / "out") == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", ["finetune", "embed"])
@pytest.mark.parametrize("backend, environment", [("triton", None), ("auto", "triton"), (None, "bogus")])
def test_a_backend_the_device_cannot_run_is_refused_before_the_data(tmp_path, tiny_model, capsys, monkeypatch,
                                                                    command, backend, environment):
    """--backend triton without CUDA (or FASTBERT_BACKEND=triton, which "auto" follows) was a RuntimeError traceback
    at the first forward, exit 1, once the data and the model were read; a bad FASTBERT_BACKEND was refused as late.
    Both are now refused with the other options: the missing data file is never reached."""
    from fastbert import ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernels on CPU
    if environment is None:
        monkeypatch.delenv("FASTBERT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("FASTBERT_BACKEND", environment)
    missing = str(tmp_path / "missing.txt")
    argv = {"finetune": ["--task", "classification", "--train", missing, "--out", str(tmp_path / "out"),
                         "--no-progress"],
            "embed": ["--input", missing, "--out", str(tmp_path / "x.npy")]}[command]
    argv = [command, "--model", tiny_model, "--device", "cpu", *argv, *(["--backend", backend] if backend else [])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "missing.txt" not in err, err
    if environment == "bogus":
        assert "FASTBERT_BACKEND must be 'auto', 'triton' or 'torch', got 'bogus'" in err, err
    else:
        named = "--backend triton" if backend == "triton" else "FASTBERT_BACKEND=triton (which --backend auto follows)"
        assert f"{named} cannot run on the device here, cpu" in err, err
        assert ops.TRITON_IMPORT_ERROR is not None or "TRITON_INTERPRET=1" in err, err
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("command", ["finetune", "embed"])
def test_an_out_under_a_file_is_refused_before_the_data(tmp_path, tiny_model, capsys, command):
    """--out under a file was a bare "[Errno 17] File exists" naming no flag, once the data and the model were
    loaded; now it names --out and the file, before the data is read, and the file is left as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file")
    out = str(notes / "sub" / ("x.npy" if command == "embed" else "out"))
    missing = str(tmp_path / "missing.txt")
    argv = {"finetune": ["--task", "classification", "--train", missing, "--no-progress"],
            "embed": ["--input", missing]}[command]
    assert cli.main([command, "--model", tiny_model, "--out", out, "--backend", "torch", *argv]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {notes} is a file" in err and "missing.txt" not in err, err
    assert notes.read_text() == "a user's file" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_an_output_lock_lives_in_the_cache_and_is_shared_through_symlinks(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTBERT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "outputs").mkdir()
    os.symlink(tmp_path / "outputs", tmp_path / "link")
    with output_lock(str(tmp_path / "outputs" / "model")):
        assert os.listdir(tmp_path / "outputs") == []  # nothing beside the output
        assert len(os.listdir(tmp_path / "cache" / "locks")) == 1
        with pytest.raises(OSError, match="being written by another fastbert process"):
            with output_lock(str(tmp_path / "link" / "model")):
                pass
    with output_lock(str(tmp_path / "link" / "model")):  # released: the next writer takes it
        pass
    assert os.listdir(tmp_path / "outputs") == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_get_the_umask_permissions(tmp_path, tiny_model, umask, monkeypatch):
    monkeypatch.setenv("FASTBERT_CACHE", str(tmp_path / "cache"))  # the lock files are counted too
    corpus = write_corpus(tmp_path / "corpus.txt", documents=6)
    previous = os.umask(umask)
    try:
        fastbert.BertModel(fastbert.BertConfig.tiny()).save_pretrained(str(tmp_path / "model"))
        assert cli.main(embed_argv(tmp_path, tiny_model)) == 0
        prepare_module.prepare_dataset([corpus], str(tmp_path / "data"), vocab_size=100, max_seq_lengths=(24,))
    finally:
        os.umask(previous)
    written = [os.path.join(folder, name) for folder, _, names in os.walk(tmp_path) for name in names
               if not name.startswith(("input.txt", "corpus.txt"))]
    assert len(written) >= 12 and {p for p in written if p.endswith(("model.safetensors", "f.npy", ".bin"))}
    assert {p: oct(os.stat(p).st_mode & 0o777) for p in written} == {p: oct(0o666 & ~umask) for p in written}


# embed ------------------------------------------------------------------------------------------------
def embed_argv(tmp_path, model, *options):
    source = tmp_path / "input.txt"
    source.write_text("the movie was good\nthe film was bad ||| so it was\nthe plot\n")
    return ["embed", "--model", model, "--input", str(source), "--out", str(tmp_path / "f.npy"),
            "--backend", "torch", "--batch-size", "1", "--layers=-2,-1", *options]


def test_embed_interrupted_or_bad_batch_size_leaves_the_previous_file(tmp_path, tiny_model, monkeypatch):
    assert cli.main(embed_argv(tmp_path, tiny_model)) == 0
    before = digest(tmp_path)
    calls = []

    def forward_then_interrupt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    original = fastbert.BertModel.forward
    monkeypatch.setattr(fastbert.BertModel, "forward", forward_then_interrupt)
    assert cli.main(embed_argv(tmp_path, tiny_model, "--layers=-1")) == 130  # Ctrl-C: a message, no traceback
    monkeypatch.undo()
    assert digest(tmp_path) == before and not leftovers(tmp_path)
    assert cli.main(embed_argv(tmp_path, tiny_model, "--batch-size", "0")) == 2
    assert digest(tmp_path) == before
    # a per-sequence run removes the per-token run's tokens file, which would not describe it
    assert cli.main(embed_argv(tmp_path, tiny_model, "--per", "sequence")) == 0
    assert np.load(tmp_path / "f.npy").shape == (3, 2 * 32) and not (tmp_path / "f.tokens.jsonl").exists()


def full_disk_case(tmp_path, model, command):
    """(argv of a good run, argv of a rerun that writes a different output, the output, a file size the
    rerun's output passes)."""
    if command == "embed":
        return embed_argv(tmp_path, model), embed_argv(tmp_path, model, "--layers=-1"), "f.npy", 2048
    if command == "finetune":
        write_sentiment(tmp_path / "train.tsv", 24, seed=1)
        argv = ["finetune", "--task", "classification", "--model", model, "--train", str(tmp_path / "train.tsv"),
                "--out", str(tmp_path / "out"), "--max-steps", "1", "--no-progress", "--device", "cpu"]
        return argv, [*argv, "--seed", "7"], "out", 20000
    if command == "convert":
        fastbert.BertModel(fastbert.BertConfig.tiny()).save_pretrained(str(tmp_path / "big"))
        return ["convert", model, str(tmp_path / "dst")], ["convert", str(tmp_path / "big"), str(tmp_path / "dst")], \
            "dst", 20000
    corpus = write_corpus(tmp_path / "corpus.txt", documents=30, sentences=8)
    argv = ["prepare-data", "--corpus", corpus, "--out", str(tmp_path / "data"), "--vocab-size", "200",
            "--max-seq-length", "48", "--workers", "1"]
    return argv, [*argv, "--seed", "7", "--overwrite"], "data", 4096


def assert_full_disk_message(result, reason, output):
    """One message naming the output, the space it needs (or what fit) and what is free; exit 2."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    message = re.search(rf"error: \[Errno \d+\] {reason} while writing {re.escape(str(output))}\b(.*)", result.stderr)
    assert message and re.search(r"\((it needs|[\d.]+ \w+ written before it failed).* free there; free some space",
                                 message.group(1)), result.stderr
    assert "is unchanged" in message.group(1) or "are unchanged" in message.group(1), result.stderr


FULL_DISK_COMMANDS = ["embed", "finetune", "prepare-data", "convert"]


@pytest.mark.parametrize("command", FULL_DISK_COMMANDS)
def test_a_full_disk_is_a_message_and_the_previous_output_stays(tmp_path, tiny_model, command):
    """The same path as test_a_full_tmpfs_is_a_message_and_the_previous_output_stays, without a mount: a file
    size limit makes the kernel fail the writes (EFBIG) where a full disk fails them (ENOSPC)."""
    good, rerun, output, limit = full_disk_case(tmp_path, tiny_model, command)
    assert cli.main(good) == 0
    before = digest(tmp_path)
    assert_full_disk_message(run_fastbert(rerun, file_size_limit=limit), "File too large", tmp_path / output)
    if command == "prepare-data":  # the shards that were finished stay for a rerun, beside the dataset
        shutil.rmtree(tmp_path / "data" / ".partial-seq48")
    assert digest(tmp_path) == before and not leftovers(tmp_path)


@pytest.mark.parametrize("command", FULL_DISK_COMMANDS)
def test_a_full_tmpfs_is_a_message_and_the_previous_output_stays(tmp_path, tiny_model, command):
    with small_disk(tmp_path / "disk", "16m") as disk:
        good, rerun, output, _ = full_disk_case(disk, tiny_model, command)
        assert cli.main(good) == 0
        before = digest(disk)
        fill(disk, leave=0)
        assert_full_disk_message(run_fastbert(rerun), "No space left on device", disk / output)
        os.remove(disk / ".filler")
        if command == "prepare-data":
            shutil.rmtree(disk / "data" / ".partial-seq48")
        assert digest(disk) == before and not leftovers(disk)


# every writer of fastbert's under a file size limit: (file or directory it writes, what the parent writes there
# first, what the child writes then: more than WRITER_LIMIT bytes)
WRITER_LIMIT = 30_000
WRITERS = {
    "write_text": ("f.txt", "write_text(out, 'old')", "write_text(out, 'x' * 100_000)"),
    "metrics.jsonl": ("metrics.jsonl", "write_text(out, json.dumps({'step': 1}) + '\\n')",
                      "MetricsLog(out, True, resume_step=1).write({'step': 2, 'note': 'x' * 100_000})"),
    "save_pretrained": ("model", "BertModel(BertConfig(**SMALL)).save_pretrained(out)",
                        "BertModel(BertConfig.tiny()).save_pretrained(out)"),
    "save_pretrained .bin": ("model", "BertModel(BertConfig(**SMALL)).save_pretrained(out, safe_serialization=False)",
                             "BertModel(BertConfig.tiny()).save_pretrained(out, safe_serialization=False)"),
    "config.json": ("config.json", "BertConfig().to_json(out)", "BertConfig(num_labels=5000).to_json(out)"),
    "bench results": ("rows.json", "write_rows(out, [])", "write_rows(out, [{'x': 'y' * 100_000}])"),
    "tokenizers' save": ("tokenizer.json", "write_text(out, 'old')",  # the family's tokenizer.json (Rust's error)
                         "with replaced_file(out) as partial: WORDPIECE.save(partial)"),
}
WRITER = textwrap.dedent("""
    import json, sys
    from fastbert import BertConfig, BertModel
    from fastbert.bench.runner import write_rows
    from fastbert.files import replaced_file, write_text
    from fastbert.train.metrics import MetricsLog
    from tokenizers import Tokenizer, models
    SMALL = dict(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    WORDPIECE = Tokenizer(models.WordPiece({f"w{i}": i for i in range(5000)} | {"[UNK]": 5000}, unk_token="[UNK]"))
    out = sys.argv[1]
    try:
        exec(sys.argv[2])
    except OSError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
""")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_handles_a_full_disk_the_same_way(tmp_path, writer):
    """Each write of fastbert's that fails for want of space: an OSError naming the file and the space it needs,
    nothing partial left, the previous file intact (a file size limit fails the writes as a full disk)."""
    name, before, after = WRITERS[writer]
    out = str(tmp_path / name)
    assert run_fastbert([out, before], code=WRITER).returncode == 0
    previous = digest(tmp_path)
    result = run_fastbert([out, after], file_size_limit=WRITER_LIMIT, code=WRITER)
    assert result.returncode == 2, result.stderr
    space = r"(it needs about [\d.]+ \w+|[\d.]+ \w+ written before it failed), [\d.]+ \w+ free there"
    kept = "(the previous output, if any, is|its earlier lines are) unchanged"
    assert re.match(rf"\[Errno 27\] File too large while writing {re.escape(out)} \({space}; free some space or "
                    rf"choose another output\); {kept}", result.stderr), result.stderr
    assert digest(tmp_path) == previous and not leftovers(tmp_path)
    assert not os.path.isdir(out) or not leftovers(out)


def long_input(path, lines):
    """`lines` sequences of 60 words: per-token features of 62 tokens each."""
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choice(FILLER) for _ in range(60)) + "\n" for _ in range(lines)))
    return path


def test_embed_onto_a_full_tmpfs_is_a_message_not_a_sigbus(tmp_path, tiny_model):
    """The features file is memory-mapped: a file made at its size by a seek has no blocks, and rows written into
    it on a full disk killed the process with SIGBUS (exit 135), leaving the sparse partial file."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        assert cli.main(embed_argv(disk, tiny_model)) == 0
        before = digest(disk)
        argv = embed_argv(disk, tiny_model, "--input", str(long_input(tmp_path / "long.txt", 100)))
        result = run_fastbert(argv)  # 100 x 62 tokens x 64 floats: 1.6 MB
        assert result.returncode != -signal.SIGBUS, "killed by SIGBUS"
        assert_full_disk_message(result, "No space left on device", disk / "f.npy")
        assert re.search(r"it needs about 1\.5 MiB, [\d.]+ KiB free there", result.stderr), result.stderr
        assert digest(disk) == before and not leftovers(disk)


def test_embed_reserves_the_blocks_of_its_features_before_writing_them(tmp_path, tiny_model, monkeypatch, capsys):
    """What keeps a full disk from being a SIGBUS, without a mount: when the first row is written, the partial
    file's blocks are all allocated; and an ENOSPC from reserving them is the message."""
    blocks = []

    def forward(self, *args, **kwargs):
        if not blocks:
            partial = next(name for name in os.listdir(tmp_path) if name.startswith(".f.npy.partial-"))
            stat = os.stat(tmp_path / partial)
            blocks.append((stat.st_blocks * 512, stat.st_size))
        return original(self, *args, **kwargs)

    original = fastbert.BertModel.forward
    with monkeypatch.context() as patch:
        patch.setattr(fastbert.BertModel, "forward", forward)
        assert cli.main(embed_argv(tmp_path, tiny_model)) == 0
    (allocated, size), = blocks
    assert allocated >= size, f"{allocated} of {size} bytes allocated: a sparse file"
    before = digest(tmp_path)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    capsys.readouterr()
    assert cli.main(embed_argv(tmp_path, tiny_model, "--layers=-1")) == 2
    assert f"No space left on device while writing {tmp_path / 'f.npy'} (it needs about " in capsys.readouterr().err
    assert digest(tmp_path) == before and not leftovers(tmp_path)


# bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_regression_labels_are_refused(tmp_path, tiny_model, value):
    (tmp_path / "train.tsv").write_text(f"sentence\tlabel\nthe movie\t1.5\nthe film\t{value}\n")
    with pytest.raises(DataError, match=rf"train.tsv:3: label '{value}' .* is not a finite number"):
        finetune(FinetuneConfig("regression", tiny_model, str(tmp_path / "train.tsv"), out=str(tmp_path / "out"),
                                **FAST))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "NaN"])
def test_a_nan_classification_label_is_refused(tmp_path, tiny_model, value):
    """Not a class of its own: pandas (and so datasets' CSV reader, which transformers' examples use) reads it as
    a missing label."""
    (tmp_path / "train.tsv").write_text(f"sentence\tlabel\nthe movie\t1\nthe film\t{value}\nthe plot\t0\n")
    with pytest.raises(DataError, match=rf"train.tsv:3: label '{value}' in column 'label' is a missing value \(NaN\)"):
        finetune(FinetuneConfig("classification", tiny_model, str(tmp_path / "train.tsv"), out=str(tmp_path / "out"),
                                **FAST))
    assert not (tmp_path / "out").exists()


def test_misaligned_squad_answer_is_refused(tmp_path, tiny_model):
    write_squad(tmp_path / "train.json", 4, seed=0)
    data = json.loads((tmp_path / "train.json").read_text())
    data["data"][0]["paragraphs"][2]["qas"][0]["answers"][0]["answer_start"] += 1
    (tmp_path / "train.json").write_text(json.dumps(data, indent=1))
    cfg = FinetuneConfig("question-answering", tiny_model, str(tmp_path / "train.json"), out=str(tmp_path / "out"),
                         max_seq_length=64, max_query_length=8, **FAST)
    with pytest.raises(DataError, match=r"train.json:\d+: data\[0\].paragraphs\[2\].qas\[0\].answers\[0\] "
                                        r"\(id 'q2'\): the context at answer_start \d+ reads '.*', not the answer"):
        finetune(cfg)


def test_a_table_is_refused_for_token_classification(tmp_path, tiny_model):
    (tmp_path / "ner.txt").write_text("sentence\tlabel\nthe movie was good\tpos\n")
    write_sentiment(tmp_path / "train.tsv", 8, seed=1)
    for train, message in ((tmp_path / "train.tsv", "not a .tsv table"),
                           (tmp_path / "ner.txt", "ner.txt:2: a tab-separated field holds several words")):
        with pytest.raises(DataError, match=message):
            finetune(FinetuneConfig("token-classification", tiny_model, str(train), out=str(tmp_path / "o"), **FAST))


@pytest.mark.parametrize("content", ["not json", '{"version": "1.0", "trunc'])
def test_a_damaged_tokenizer_json_is_a_message(tmp_path, tiny_model, content, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((open(os.path.join(tiny_model, name), "rb")).read())
    (model / "tokenizer.json").write_text(content)
    assert cli.main(embed_argv(tmp_path, str(model))) == 2
    assert f"{model / 'tokenizer.json'}: not a valid tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "f.npy").exists()


@pytest.mark.parametrize("shape, dtype, message", [
    ((2, 0), torch.int64, r"at least one token, got input shape \(2, 0\)"),
    ((2, 3), torch.uint8, "must be int64 or int32"),
    ((2, 3), torch.int16, "must be int64 or int32")])
def test_model_refuses_empty_sequences_and_narrow_ids(shape, dtype, message):
    model = fastbert.BertModel(fastbert.BertConfig.tiny())
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(shape, dtype=dtype))


# prepare-data and the built-in corpus cache ----------------------------------------------------------------
def prepare_files(out):
    """{relative path: sha256} of every file of a prepare-data output."""
    files = {}
    for folder, _, names in os.walk(out):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, out)] = digest(path)
    return files


def prepare(corpus, out, **options):
    values = dict(vocab_size=200, max_seq_lengths=(24, 48), chunk_bytes=2048, workers=1)
    return prepare_module.prepare_dataset([str(corpus)], str(out), **{**values, **options})


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.txt", documents=30, sentences=8)


def test_prepare_data_is_deterministic_whatever_the_workers(tmp_path, corpus):
    prepare(corpus, tmp_path / "a")
    prepare(corpus, tmp_path / "b")  # WordPiece trained again in the same process: its hash maps differ
    prepare(corpus, tmp_path / "c", workers=2)
    first = prepare_files(tmp_path / "a")
    assert len([n for n in first if n.endswith(".bin")]) >= 2 * 3  # several shards per length
    assert prepare_files(tmp_path / "b") == first == prepare_files(tmp_path / "c")


def test_adding_a_sequence_length_reuses_the_tokenizer(tmp_path, corpus, caplog):
    prepare(corpus, tmp_path / "a", max_seq_lengths=(24,))
    tokenizer = digest(tmp_path / "a" / "tokenizer.json")
    before = prepare_files(tmp_path / "a")
    with caplog.at_level("INFO", logger="fastbert.data"):
        prepare(corpus, tmp_path / "a", max_seq_lengths=(24, 48))
    assert "as for this directory's other datasets" in caplog.text and "already prepared" in caplog.text
    after = prepare_files(tmp_path / "a")
    assert {k: v for k, v in after.items() if k in before} == before  # seq24 and the tokenizer untouched
    assert digest(tmp_path / "a" / "tokenizer.json") == tokenizer
    indexes = [json.loads((tmp_path / "a" / f"seq{n}" / "index.json").read_text()) for n in (24, 48)]
    assert indexes[0]["tokenizer_sha256"] == indexes[1]["tokenizer_sha256"]
    other = tmp_path / "other-vocab.txt"
    other.write_text("".join(t + "\n" for t in [*SPECIAL_TOKENS, "the", "cat"]))
    with pytest.raises(ValueError, match="differs from .*tokenizer.json, which the datasets in .* use"):
        prepare(corpus, tmp_path / "a", tokenizer=str(other))
    with pytest.raises(ValueError, match=r"seq24 exists and was prepared otherwise \(seed: 12345 then, 7 now\)"):
        prepare(corpus, tmp_path / "a", seed=7)


def test_interrupted_prepare_data_resumes_and_keeps_the_previous_dataset(tmp_path, corpus, monkeypatch):
    prepare(corpus, tmp_path / "whole")
    prepare(corpus, tmp_path / "a", seed=1)
    before = prepare_files(tmp_path / "a")
    built = []

    def build_then_interrupt(job):
        if len(built) == 2:
            raise KeyboardInterrupt
        built.append(job[0])
        return original(job)

    original = prepare_module.build_shards
    monkeypatch.setattr(prepare_module, "build_shards", build_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, tmp_path / "a", overwrite=True)
    assert {k: v for k, v in prepare_files(tmp_path / "a").items() if not k.startswith(".partial")} == before
    built.clear()
    monkeypatch.setattr(prepare_module, "build_shards", lambda job: (built.append(job[0]), original(job))[1])
    prepare(corpus, tmp_path / "a", overwrite=True)
    assert built and 0 not in built and 1 not in built  # the two finished shards were not built again
    assert prepare_files(tmp_path / "a") == prepare_files(tmp_path / "whole")


def test_a_run_waiting_for_the_lock_survives_the_holder_removing_the_out_it_created(tmp_path, corpus, caplog):
    """A prepare-data run that created --out removes it when its input proves bad; a second run waiting for its
    lock meanwhile then found no --out (FileNotFoundError once it got the lock). It makes --out again."""
    import logging
    import threading

    out, waiting, results = tmp_path / "a", threading.Event(), []

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for another fastbert process" in record.getMessage():
                waiting.set()

    def second_run():
        try:
            results.append(prepare(corpus, out))
        except Exception as error:  # the assertion below names it
            results.append(error)

    handler = Waiting()
    logging.getLogger("fastbert").addHandler(handler)
    try:
        with caplog.at_level("INFO", logger="fastbert"), output_lock(str(out / "prepare")):  # the first run, which created --out
            thread = threading.Thread(target=second_run)
            thread.start()
            assert waiting.wait(timeout=60)
            shutil.rmtree(out)  # its input proved bad
        thread.join(timeout=300)
    finally:
        logging.getLogger("fastbert").removeHandler(handler)
    assert len(results) == 1 and not isinstance(results[0], Exception), results
    prepare(corpus, tmp_path / "alone")
    assert prepare_files(out) == prepare_files(tmp_path / "alone")


def test_a_failed_run_removes_only_an_out_it_made_under_the_lock(tmp_path, caplog):
    """A run that found no --out before waiting for the lock took itself for its maker: when another run made and
    filled --out meanwhile, its failure removed that run's dataset. Whether it made --out is decided under the lock."""
    import threading

    out, results = tmp_path / "a", []
    with caplog.at_level("INFO", logger="fastbert"), output_lock(str(out / "prepare")):
        shutil.rmtree(out)  # not there when the failing run starts
        thread = threading.Thread(target=lambda: results.append(pytest.raises(
            ValueError, prepare, write_corpus(tmp_path / "one.txt", documents=1), out)))
        thread.start()
        deadline = time.monotonic() + 60
        while "waiting for another fastbert process" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        out.mkdir()
        (out / "theirs.txt").write_text("what the run holding the lock wrote")
    thread.join(timeout=300)
    assert results and "needs at least 2" in str(results[0].value)
    assert (out / "theirs.txt").read_text() == "what the run holding the lock wrote"


def test_a_failed_run_removes_the_out_it_created_while_it_holds_the_lock(tmp_path, monkeypatch):
    """Removed after the lock was released, the --out would go from under a run that took the lock in between."""
    import filelock

    from fastbert.files import lock_path

    out, held = tmp_path / "a", []

    def rmtree(path, ignore_errors=False):
        if os.path.abspath(path) == str(out):
            try:
                filelock.FileLock(lock_path(str(out / "prepare"))).acquire(timeout=0).lock.release()
                held.append(False)
            except filelock.Timeout:
                held.append(True)
        real_rmtree(path, ignore_errors=ignore_errors)

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(prepare_module.shutil, "rmtree", rmtree)
    with pytest.raises(ValueError, match="needs at least 2"):
        prepare(write_corpus(tmp_path / "one.txt", documents=1), out)
    assert held == [True] and not out.exists()


def test_a_damaged_dataset_index_is_a_message(tmp_path, corpus):
    prepare(corpus, tmp_path / "a")
    (tmp_path / "a" / "seq24" / "index.json").write_text('{"format_version": 1, "max_seq')
    with pytest.raises(ValueError, match=r"seq24/index.json: damaged"):
        ShardedDataset(str(tmp_path / "a" / "seq24"))
    with pytest.raises(ValueError, match=r"seq24 exists and was prepared otherwise \(.*index.json: damaged"):
        prepare(corpus, tmp_path / "a")
    prepare(corpus, tmp_path / "a", overwrite=True)
    assert len(ShardedDataset(str(tmp_path / "a" / "seq24"))) > 0


BUILTIN = textwrap.dedent("""
    from fastbert.command import configure_logging
    from fastbert.data import corpus, prepare
    configure_logging("pretrain")
    files = corpus.stdlib_files()[:30]  # a slice of the standard library keeps the test short
    corpus.stdlib_files = lambda: files
    root = prepare.builtin_dataset(300, [32, 64])
    print(root)
""")


def builtin(cache, wait=True):
    process = subprocess.Popen([sys.executable, "-c", BUILTIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "FASTBERT_CACHE": str(cache)})
    return process.communicate() + (process.returncode,) if wait else process


def test_two_runs_preparing_the_builtin_corpus_at_once_share_one_cache(tmp_path):
    first, second = builtin(tmp_path, wait=False), builtin(tmp_path, wait=False)
    results = [p.communicate() + (p.returncode,) for p in (first, second)]
    assert [rc for _, _, rc in results] == [0, 0], results
    root = results[0][0].strip()
    assert results[1][0].strip() == root
    logs = "".join(err for _, err, _ in results)
    assert logs.count("examples from") == 2  # each length was built once, by one of the two
    assert "waiting for another fastbert process" in logs or logs.count("already prepared") == 2
    datasets = [ShardedDataset(os.path.join(root, f"seq{n}")) for n in (32, 64)]
    assert all(len(d) > 0 for d in datasets)
    # a damaged cache is rebuilt, not an error for good
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        f.write('{"truncated')
    out, err, rc = builtin(tmp_path)
    assert rc == 0 and "rebuilding the built-in corpus's cache" in err, err
    assert ShardedDataset(os.path.join(root, "seq32")).metadata["fingerprint"] == datasets[0].metadata["fingerprint"]


def test_every_row_of_the_reliability_table_names_a_test_that_exists():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "reliability.md"), encoding="utf-8") as f:
        rows = [line.rstrip() for line in f if line.startswith("| ") and not line.startswith(("| fault", "| ---"))]
    tests = {}
    for row in rows:
        match = re.fullmatch(r"`(tests/\w+\.py)::(\w+)`", row.rstrip("|").rsplit("|", 1)[1].strip())
        assert match, f"the last cell of this row is not one test: {row}"
        file, name = match.groups()
        if file not in tests:
            with open(os.path.join(root, file), encoding="utf-8") as f:
                tests[file] = {node.name for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)}
        assert name in tests[file], f"{file} has no {name}: {row}"
    assert len(rows) >= 40
