"""`fastbert convert`, `finetune --model` and `embed --model` on BERT's family: tiny random checkpoints built
with transformers' own classes (tests/family_models.py), each beside the kind of tokenizer it ships, built
here with `tokenizers`: byte-level BPE (RoBERTa), Unigram with SentencePiece's pre-tokenizer (XLM-R,
CamemBERT), WordPiece with BERT's template (DistilBERT, ELECTRA) and with RoBERTa's (MPNet).

What must hold: inputs are laid out as the tokenizer's own template (what transformers' AutoTokenizer gives
for a pair), convert's check passes, fine-tuning runs every task family and saves a checkpoint whose loss
transformers reproduces, and embed's features are transformers' hidden states.
"""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from family_models import hf_config, head_class, randomize
from fastbert import cli
from fastbert.finetune import FinetuneConfig, finetune
from fastbert.finetune.encoding import Packer, tokenizer_for
from fastbert.finetune.readers import QAExample, TaggedSentence
from fastbert.finetune.squad import QuestionAnsweringTask
from fastbert.finetune.tasks import TokenTask

transformers = pytest.importorskip("transformers")
tk = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ("the a movie film was is good bad great awful plot story john mary paul paris rome red blue fox dog cat "
         "what animal saw in and then very").split()
CORPUS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's and MPNet's ids: <pad> = 1
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOKENIZER_KIND = {"roberta": "bpe", "xlm-roberta": "unigram", "camembert": "unigram", "distilbert": "wordpiece",
                  "electra": "wordpiece", "mpnet": "mpnet"}
CHECKPOINT_HEAD = {arch: "ForMaskedLM" for arch in TOKENIZER_KIND} | {"electra": "ForPreTraining"}
PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert", "distilbert": "DistilBert",
          "electra": "Electra", "mpnet": "MPNet"}
FAST = dict(learning_rate=1e-3, progress=False, backend="torch", device="cpu", batch_size=4, max_steps=3)


def roberta_template(tokenizer):
    s, e = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    return tk.processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                            special_tokens=[("<s>", s), ("</s>", e)])


def build_tokenizer(kind: str):
    """The `tokenizers.Tokenizer` of a kind, trained on CORPUS (or with a vocabulary of its words), with the
    post-processor its models ship."""
    if kind == "bpe":
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        tokenizer.train_from_iterator(CORPUS, tk.trainers.BpeTrainer(
            vocab_size=320, min_frequency=1, special_tokens=ROBERTA_SPECIALS, show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
        tokenizer.post_processor = tk.processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        return tokenizer
    if kind == "unigram":
        tokenizer = tk.Tokenizer(tk.models.Unigram())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace()
        tokenizer.decoder = tk.decoders.Metaspace()
        tokenizer.train_from_iterator(CORPUS * 20, tk.trainers.UnigramTrainer(
            vocab_size=200, special_tokens=ROBERTA_SPECIALS, unk_token="<unk>", show_progress=False))
        tokenizer.post_processor = roberta_template(tokenizer)
        return tokenizer
    specials = BERT_SPECIALS if kind == "wordpiece" else ROBERTA_SPECIALS
    vocab = {token: i for i, token in enumerate(specials + sorted(set(WORDS)) + ["?", "##s"])}
    tokenizer = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token=specials[1] if kind == "wordpiece" else "<unk>"))
    tokenizer.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tk.decoders.WordPiece()
    if kind == "wordpiece":
        tokenizer.post_processor = tk.processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    else:
        tokenizer.post_processor = roberta_template(tokenizer)
    return tokenizer


def save_tokenizer(tokenizer, kind: str, directory) -> None:
    """As transformers saves it: tokenizer.json and tokenizer_config.json (the class, the special tokens)."""
    if kind == "bpe":
        wrapped = transformers.RobertaTokenizerFast(tokenizer_object=tokenizer)
    else:
        names = ("cls_token", "sep_token", "pad_token", "unk_token", "mask_token")
        tokens = BERT_SPECIALS[2:4] + BERT_SPECIALS[:2] + BERT_SPECIALS[4:] if kind == "wordpiece" else \
            ["<s>", "</s>", "<pad>", "<unk>", "<mask>"]
        # XLM-R's and MPNet's tokenizers give no token_type_ids; the BERT-type ones do
        inputs = ["input_ids", "token_type_ids", "attention_mask"] if kind == "wordpiece" else \
            ["input_ids", "attention_mask"]
        wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_input_names=inputs,
                                                       **dict(zip(names, tokens)))
    wrapped.save_pretrained(str(directory))


def make_checkpoint(directory, arch: str, head: str, seed: int = 0, **config):
    """transformers' `head` model of `arch` with random weights and its tokenizer, saved in `directory`."""
    kind = TOKENIZER_KIND[arch]
    tokenizer = build_tokenizer(kind)
    hf = hf_config(arch)
    hf.vocab_size = tokenizer.get_vocab_size()
    for name, value in config.items():
        setattr(hf, name, value)
    torch.manual_seed(seed)
    randomize(head_class(arch, head)(hf), seed).save_pretrained(str(directory))
    save_tokenizer(tokenizer, kind, directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a masked-LM (ELECTRA: discriminator) checkpoint directory with its tokenizer."""
    root = tmp_path_factory.mktemp("family")
    return {arch: make_checkpoint(root / arch, arch, CHECKPOINT_HEAD[arch]) for arch in TOKENIZER_KIND}


def model_type(directory) -> str:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)["model_type"]


def packer_for(directory, max_seq_length=32) -> Packer:
    types = model_type(directory) in ("electra", "bert")
    return Packer(tokenizer_for(directory, model_type=model_type(directory)), max_seq_length, token_types=types)


# ------------------------------------------------------------------------------------------------ templates
@pytest.mark.parametrize("arch", sorted(TOKENIZER_KIND))
def test_inputs_follow_the_tokenizers_own_template(checkpoints, arch):
    """Single sentences and pairs packed as transformers' AutoTokenizer packs them; token types only for
    models that have them."""
    directory = checkpoints[arch]
    packer = packer_for(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for a, b in (("john saw a red fox", None), ("the movie was good", "a red fox")):
        packed = packer.pack(*packer.tokenize([a] + ([b] if b else [])))
        expected = theirs(a, b) if b else theirs(a)
        assert packed["input_ids"] == expected["input_ids"], (a, b)
        if arch in ("electra", "distilbert"):
            assert theirs.convert_ids_to_tokens(packed["input_ids"][0]) == "[CLS]"
        else:  # RoBERTa's first token is <s>, and a pair has two </s> between its segments
            tokens = theirs.convert_ids_to_tokens(packed["input_ids"])
            assert tokens[0] == "<s>" and (b is None or tokens.count("</s>") == 3)
        if arch == "electra":
            assert packed["token_type_ids"] == expected["token_type_ids"]
            assert b is None or 1 in packed["token_type_ids"]  # BERT's types: 1 on the second segment
        else:
            assert "token_type_ids" not in packed


def test_pair_truncation_keeps_the_template(checkpoints):
    packer = packer_for(checkpoints["roberta"], max_seq_length=9)  # a pair's 4 special tokens and 5 of text
    packed = packer.pack([10, 11, 12, 13, 14, 15], [20, 21])  # the longer side loses tokens first
    assert packed["input_ids"] == [0, 10, 11, 12, 2, 2, 20, 21, 2]


def test_tokenizer_without_tokenizer_json_through_autotokenizer(checkpoints, tmp_path):
    """A RoBERTa directory with vocab.json + merges.txt and no tokenizer.json: transformers' AutoTokenizer
    reads them, and packs as the tokenizer.json it was written from."""
    directory = tmp_path / "roberta"
    shutil.copytree(checkpoints["roberta"], directory)
    tokenizer = tokenizer_for(str(directory), model_type="roberta")
    tokenizer.model.save(str(directory))  # vocab.json, merges.txt
    (directory / "tokenizer.json").unlink()
    with_json, without = packer_for(checkpoints["roberta"]), packer_for(str(directory))
    texts = ["john saw a red fox", "the movie was good"]
    assert [without.pack(x)["input_ids"] for x in without.tokenize(texts)] == \
        [with_json.pack(x)["input_ids"] for x in with_json.tokenize(texts)]
    (directory / "vocab.json").unlink()
    (directory / "merges.txt").unlink()
    with pytest.raises(ValueError, match="has no tokenizer files"):
        tokenizer_for(str(directory), model_type="roberta")


def test_tagging_labels_sit_on_each_words_first_piece(checkpoints):
    """RoBERTa's byte-level pieces after <s>: a word's tag on its first piece, -100 elsewhere."""
    packer = packer_for(checkpoints["roberta"])
    task = TokenTask(packer)
    sentence = TaggedSentence("t.conll", 1, ["john", "saw", "paris"], ["B-PER", "O", "B-LOC"])
    task.fit([sentence])
    inputs, meta = task.features([sentence])
    ids, labels = inputs[0]["input_ids"], inputs[0]["labels"]
    assert ids[0] == 0 and ids[-1] == 2 and len(labels) == len(ids) and "token_type_ids" not in inputs[0]
    assert sorted(meta[0]) == [0, 1, 2]
    for word, position in meta[0].items():
        assert labels[position] == task.label_ids[sentence.tags[word]]
        assert packer.tokenizer.decode([ids[position]]).strip() == sentence.words[word][:len(
            packer.tokenizer.decode([ids[position]]).strip())]
    assert sum(label != -100 for label in labels) == 3
    # the words' pieces are those of running text, each word with its leading space (Ġ), as transformers'
    # add_prefix_space=True splits them
    assert ids[1:-1] == packer.tokenize([" john saw paris"])[0]


def test_question_answering_positions_hold_the_answer(checkpoints):
    """XLM-R's template <s> question </s></s> context </s>: the labelled span of every window that holds
    the answer decodes to the answer; the others point at <s>."""
    packer = packer_for(checkpoints["xlm-roberta"], max_seq_length=24)
    task = QuestionAnsweringTask(packer, doc_stride=6, max_query_length=8)
    context = "the movie was good then john saw a red fox in paris and the plot was great"
    example = QAExample("q0", "what animal ?", context, [("red fox", context.index("red fox"))], False)
    task.fit([example])
    inputs, meta = task.features([example])
    assert len(inputs) > 1  # several windows
    holding = 0
    for feature in inputs:
        start, end = feature["start_positions"], feature["end_positions"]
        if start == 0:
            assert end == 0 and feature["input_ids"][0] == 0  # <s>: the null answer
            continue
        holding += 1
        assert packer.tokenizer.decode(feature["input_ids"][start:end + 1]).strip() == "red fox"
    assert holding >= 1
    # the first context token of each window sits after <s> question </s></s>, the question cut to 8 tokens
    question = min(len(packer.tokenize(["what animal ?"])[0]), 8)
    assert all(window.context_start == question + 3 for window in meta)


# -------------------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("arch", sorted(TOKENIZER_KIND))
def test_convert_check(checkpoints, arch, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert cli.main(["convert", checkpoints[arch], str(dst), "--check"]) == 0
    printed = capsys.readouterr()
    name = PREFIX[arch] + CHECKPOINT_HEAD[arch]
    assert f"{name}: " in printed.err and printed.out.rstrip().endswith("OK"), printed
    assert json.loads((dst / "config.json").read_text())["architectures"] == [name]
    assert (dst / "tokenizer.json").read_text() == open(os.path.join(checkpoints[arch], "tokenizer.json")).read()
    source = head_class(arch, CHECKPOINT_HEAD[arch]).from_pretrained(checkpoints[arch]).state_dict()
    again = head_class(arch, CHECKPOINT_HEAD[arch]).from_pretrained(str(dst)).state_dict()
    assert source.keys() == again.keys()
    for key, value in source.items():
        assert torch.equal(again[key], value), key


def test_convert_a_head_fastbert_runs_through_apply(tmp_path, capsys):
    """RobertaForSequenceClassification: fastbert has no class of its own; convert re-saves it with its
    classifier, and the check runs transformers' head on fastbert's encoder."""
    src = make_checkpoint(tmp_path / "src", "roberta", "ForSequenceClassification", seed=3, num_labels=3)
    assert cli.main(["convert", src, str(tmp_path / "dst"), "--check"]) == 0
    printed = capsys.readouterr()
    assert "RobertaForSequenceClassification: " in printed.err and printed.out.rstrip().endswith("OK"), printed
    theirs = transformers.RobertaForSequenceClassification.from_pretrained(src).state_dict()
    ours = transformers.RobertaForSequenceClassification.from_pretrained(str(tmp_path / "dst")).state_dict()
    assert torch.equal(ours["classifier.out_proj.weight"], theirs["classifier.out_proj.weight"])
    assert ours["classifier.out_proj.weight"].shape[0] == 3


def test_damaged_weights_of_a_family_head_are_a_message(tmp_path, capsys):
    """transformers' loader (convert of a head fastbert runs through apply, and fine-tuning) reports damaged
    weights as a message naming the directory; DST is not written."""
    src = make_checkpoint(tmp_path / "src", "roberta", "ForSequenceClassification")
    weights = tmp_path / "src" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert cli.main(["convert", src, str(tmp_path / "dst"), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"SRC {src}: {weights}: cannot read the weights" in err, err  # read once, by fastbert, for its dtype
    assert "Traceback" not in err and not (tmp_path / "dst").exists()
    write_pairs(tmp_path / "train.tsv", 4, seed=0)
    argv = ["finetune", "--task", "classification", "--model", src, "--train", str(tmp_path / "train.tsv"),
            "--text-column", "sentence1", "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli.main(argv) == 2
    assert f"--model {src}: transformers cannot load the weights" in capsys.readouterr().err


def test_convert_refuses_model_class_of_another_architecture(checkpoints, tmp_path, capsys):
    assert cli.main(["convert", checkpoints["mpnet"], str(tmp_path / "dst"), "--model-class", "RobertaModel"]) == 2
    assert "model_type 'mpnet' is not RoBERTa" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


# ------------------------------------------------------------------------------------------------- finetune
def write_pairs(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write("sentence1\tsentence2\tlabel\n")
        for _ in range(n):
            label = rng.integers(2)
            a = " ".join(rng.choice(WORDS, 4)) + (" good" if label else " bad")
            f.write(f"{a}\t{' '.join(rng.choice(WORDS, 3))}\t{['neg', 'pos'][label]}\n")


def read_pairs(path):
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def finetune_run(tmp_path, model, task, train, eval, **options):
    cfg = FinetuneConfig(task, model, str(train), str(eval), out=str(tmp_path / "out"), **{**FAST, **options})
    result = finetune(cfg)
    with open(os.path.join(cfg.out, "eval_results.json")) as f:
        results = json.load(f)
    assert results["history"] and all(math.isfinite(h["loss"]) for h in results["history"]), results
    assert results["best"] == result["best"] and result["steps"] == FAST["max_steps"]
    return result["best"], cfg.out


@pytest.mark.parametrize("arch", sorted(TOKENIZER_KIND))
def test_classification_on_every_architecture(checkpoints, arch, tmp_path):
    """Sentence pairs through the tokenizer's template; the saved checkpoint and tokenizer, read by plain
    transformers (AutoTokenizer's pairs, the head class), give the loss fine-tuning measured on the eval file."""
    write_pairs(tmp_path / "train.tsv", 16, seed=1)
    write_pairs(tmp_path / "dev.tsv", 8, seed=2)
    best, out = finetune_run(tmp_path, checkpoints[arch], "classification", tmp_path / "train.tsv",
                             tmp_path / "dev.tsv", text_column="sentence1", text_pair_column="sentence2")
    assert set(best) >= {"accuracy", "f1", "matthews", "loss"}
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["architectures"] == [PREFIX[arch] + "ForSequenceClassification"]
    assert config["id2label"] == {"0": "neg", "1": "pos"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = head_class(arch, "ForSequenceClassification").from_pretrained(out).eval()
    a, b, labels = read_pairs(tmp_path / "dev.tsv")
    # XLM-R's and CamemBERT's Unigram pieces here are mostly characters: pairs reach the 38 positions
    batch = tokenizer(a, b, padding=True, truncation=True, max_length=38, return_tensors="pt")
    with torch.no_grad():
        loss = model(**batch, labels=torch.tensor([config["label2id"][y] for y in labels])).loss
    assert loss.item() == pytest.approx(best["loss"], abs=1e-5)
    predictions = [json.loads(line)["prediction"] for line in open(os.path.join(out, "predictions.jsonl"))]
    assert len(predictions) == 8 and set(predictions) <= {"neg", "pos"}


def test_task_models_are_transformers_heads_on_fastbert(checkpoints, tmp_path):
    """The family fine-tunes as transformers' head class accelerated in place (its base model's forward is
    fastbert's), with the task's labels and one dropout everywhere; BERT as fastbert's own class."""
    import fastbert
    from fastbert.finetune.loading import load_config, load_task_model
    from fastbert.in_place import ACCELERATED

    config = load_config(checkpoints["distilbert"])
    model = load_task_model(config, "ForTokenClassification", checkpoints["distilbert"], 0.25, "torch",
                            num_labels=5)
    assert type(model) is transformers.DistilBertForTokenClassification and model.config.num_labels == 5
    assert ACCELERATED in vars(model.distilbert) and model.distilbert.config.dropout == 0.25
    assert model.config.attention_dropout == model.config.seq_classif_dropout == 0.25
    bert = tmp_path / "bert"
    fastbert.BertModel(fastbert.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64)).save_pretrained(str(bert))
    model = load_task_model(load_config(str(bert)), "ForSequenceClassification", str(bert), 0.25, None, num_labels=3)
    assert type(model) is fastbert.BertForSequenceClassification and model.config.hidden_dropout_prob == 0.25
    with pytest.raises(ValueError, match="transformers has no DistilBertForPreTraining"):
        load_task_model(config, "ForPreTraining", checkpoints["distilbert"], 0.1, None)


@pytest.mark.slow(reason="an end-to-end fine-tuning run on the kernels in the interpreter")
@pytest.mark.parametrize("arch", ["roberta", "mpnet"])
def test_classification_on_fastbert_kernels(arch, tmp_path):
    """--backend triton: fine-tuning runs the family on fastbert's Triton kernels (under the interpreter on a
    CPU; MPNet's relative-position bias inside the flash attention), and plain transformers reproduces the
    eval loss of the checkpoint it saved."""
    from family_models import TRITON_SIZES

    model = make_checkpoint(tmp_path / "model", arch, "ForMaskedLM", **TRITON_SIZES)
    write_pairs(tmp_path / "train.tsv", 8, seed=1)
    write_pairs(tmp_path / "dev.tsv", 4, seed=2)
    best, out = finetune_run(tmp_path, model, "classification", tmp_path / "train.tsv", tmp_path / "dev.tsv",
                             text_column="sentence1", text_pair_column="sentence2", backend="triton",
                             max_seq_length=16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reloaded = head_class(arch, "ForSequenceClassification").from_pretrained(out).eval()
    a, b, labels = read_pairs(tmp_path / "dev.tsv")
    batch = tokenizer(a, b, padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        loss = reloaded(**batch, labels=torch.tensor([reloaded.config.label2id[y] for y in labels])).loss
    assert loss.item() == pytest.approx(best["loss"], abs=1e-5)


def write_scores(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write("sentence1,sentence2,score\n")
        for _ in range(n):
            f.write(f"{' '.join(rng.choice(WORDS, 4))},{' '.join(rng.choice(WORDS, 3))},{rng.integers(5)}\n")


def write_conll(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [(w, "O") for w in rng.choice(WORDS[:12], 3)]
            words.insert(int(rng.integers(4)), (str(rng.choice(["john", "mary", "paul"])), "B-PER"))
            words.insert(int(rng.integers(5)), (str(rng.choice(["paris", "rome"])), "B-LOC"))
            f.writelines(f"{w} {t}\n" for w, t in words)
            f.write("\n")


def write_squad(path, n, seed):
    rng = np.random.default_rng(seed)
    paragraphs = []
    for i in range(n):
        words = list(rng.choice(WORDS[:12], 8))
        answer = f"{rng.choice(['red', 'blue'])} {rng.choice(['fox', 'dog', 'cat'])}"
        at = int(rng.integers(9))
        context = " ".join(words[:at] + [answer] + words[at:])
        start = len(" ".join(words[:at])) + 1 if at else 0
        paragraphs.append({"context": context, "qas": [{"id": f"q{i}", "question": "what animal ?", "answers": [
            {"text": answer, "answer_start": start}]}]})
    with open(path, "w") as f:
        json.dump({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}, f)


def write_swag(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write("sent1,sent2,ending0,ending1,label\n")
        for _ in range(n):
            label = int(rng.integers(2))
            endings = [" ".join(rng.choice(WORDS, 2)) + (" good" if k == label else "") for k in range(2)]
            f.write(f"{' '.join(rng.choice(WORDS, 4))},{rng.choice(WORDS)},{','.join(endings)},{label}\n")


# task -> (architecture, file writer, file name, options, the metrics it writes)
TASK_RUNS = {
    "regression": ("mpnet", write_scores, "scores.csv",
                   dict(text_column="sentence1", text_pair_column="sentence2", label_column="score"),
                   {"pearson", "spearman", "mse"}),
    "token-classification": ("roberta", write_conll, "tags.conll", {}, {"precision", "recall", "f1", "accuracy"}),
    "question-answering": ("xlm-roberta", write_squad, "squad.json",
                           dict(max_seq_length=32, doc_stride=8, max_query_length=8), {"exact_match", "f1"}),
    "multiple-choice": ("distilbert", write_swag, "swag.csv", dict(choice_columns=("ending0", "ending1")),
                        {"accuracy"}),
}


@pytest.mark.parametrize("task", sorted(TASK_RUNS))
def test_every_task_family(checkpoints, task, tmp_path):
    arch, write, name, options, metric_names = TASK_RUNS[task]
    write(tmp_path / f"train-{name}", 12, seed=3)
    write(tmp_path / f"dev-{name}", 6, seed=4)
    best, out = finetune_run(tmp_path, checkpoints[arch], task, tmp_path / f"train-{name}",
                             tmp_path / f"dev-{name}", **options)
    assert set(best) >= metric_names | {"loss"}
    assert all(math.isfinite(best[m]) for m in metric_names), best
    head = {"regression": "ForSequenceClassification", "token-classification": "ForTokenClassification",
            "question-answering": "ForQuestionAnswering", "multiple-choice": "ForMultipleChoice"}[task]
    assert json.loads(open(os.path.join(out, "config.json")).read())["architectures"] == [PREFIX[arch] + head]
    predictions = [json.loads(line)["prediction"] for line in open(os.path.join(out, "predictions.jsonl"))]
    assert len(predictions) == 6
    if task == "token-classification":  # transformers' tokenizer splits the words as fine-tuning read them
        from fastbert.finetune.readers import read_conll
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # RoBERTa's: add_prefix_space written for it
        model = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
        for sentence, predicted in zip(read_conll(str(tmp_path / f"dev-{name}")), predictions):
            encoded = tokenizer(sentence.words, is_split_into_words=True, return_tensors="pt")
            with torch.no_grad():
                labels = model(**encoded).logits[0].argmax(-1).tolist()
            first = {}  # each word's first piece
            for position, word in enumerate(encoded.word_ids()):
                if word is not None:
                    first.setdefault(word, model.config.id2label[labels[position]])
            assert [first[w] for w in range(len(sentence.words))] == predicted


# ---------------------------------------------------------------------------------------------------- embed
@pytest.mark.parametrize("arch", sorted(TOKENIZER_KIND))
def test_embed_matches_transformers(checkpoints, arch, tmp_path):
    lines = ["john saw a red fox in paris", "the movie was good ||| the plot was bad"]
    source = tmp_path / "input.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "features.npy"
    argv = ["embed", "--model", checkpoints[arch], "--input", str(source), "--out", str(out), "--layers=0,-1",
            "--backend", "torch"]
    assert cli.main(argv) == 0
    features = np.load(out)
    tokens = [json.loads(line) for line in out.with_suffix(".tokens.jsonl").read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
    model = head_class(arch, "Model").from_pretrained(checkpoints[arch]).eval()
    assert features.shape == (2, max(map(len, tokens)), 2 * model.config.hidden_size)
    for row, token_list, line in zip(features, tokens, lines):
        encoded = tokenizer(*line.split(" ||| "), return_tensors="pt")
        assert token_list == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
        assert token_list[0] == ("[CLS]" if arch in ("distilbert", "electra") else "<s>")
        with torch.no_grad():
            states = model(**encoded, output_hidden_states=True).hidden_states
        n = len(token_list)
        np.testing.assert_allclose(row[:n], torch.cat([states[0], states[-1]], -1)[0].numpy(), atol=1e-5, rtol=1e-5)
        assert not row[n:].any()
