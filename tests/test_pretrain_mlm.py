"""MLM-only pretraining (issue 19, item 4; RoBERTa's finding that NSP is not needed): `prepare-data
--objective mlm` packs full sentences across documents, `pretrain --objective mlm` trains the masked-LM
model on them with a new mask every epoch, resumes exactly, and neither objective takes the other's data
or checkpoints silently."""
import json
import logging
import os
import re
import random

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from fastbert import BertConfig, BertForMaskedLM, BertForPreTraining
from fastbert.family import RobertaForMaskedLM
from fastbert.family_config import RobertaConfig
from fastbert.data import prepare
from fastbert.data.examples import MLM, MLM_NSP, pack_full_sentences
from fastbert.data.loader import PretrainingLoader
from fastbert.data.masking import MaskingCollator
from fastbert.data.shards import ShardedDataset
from fastbert.hf import read_state_dict
from fastbert.train import pretrain, run
from tests.test_data import write_corpus
from tests.test_pretrain import NO_DROPOUT, SMALL

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one torch thread per test process
CLS, SEP = 2, 3
NSP_KEYS = {"nsp_loss", "nsp_accuracy"}


def numbered_documents(lengths):
    """Documents of sentences whose token ids say where they come from: (documents, {id: (doc, sentence)}).
    lengths[d][s] is the length of sentence s of document d; ids start at 10 (clear of CLS and SEP)."""
    documents, origin, next_id = [], {}, 10
    for d, sentence_lengths in enumerate(lengths):
        document = []
        for s, length in enumerate(sentence_lengths):
            document.append(list(range(next_id, next_id + length)))
            origin.update({t: (d, s) for t in document[-1]})
            next_id += length
        documents.append(document)
    return documents, origin


def test_full_sentences_fill_the_length_and_cross_documents_behind_a_separator():
    rng = random.Random(0)
    lengths = [[rng.randint(1, 9) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    documents, origin = numbered_documents(lengths)
    max_seq_length = 24
    examples = list(pack_full_sentences(documents, max_seq_length, CLS, SEP))
    bodies = []
    for e in examples:
        assert e.tokens[0] == CLS and e.tokens[-1] == SEP and len(e.tokens) <= max_seq_length
        assert e.a_length == len(e.tokens) and e.next_sentence_label == 0  # one token type, no NSP label
        bodies.append(e.tokens[1:-1])
    # nothing dropped, nothing reordered: the examples read back are the corpus
    assert [t for b in bodies for t in b if t != SEP] == [t for d in documents for s in d for t in s]
    crossings = 0
    for body in bodies:
        for before, token, after in zip(body, body[1:], body[2:]):
            if token == SEP:  # a separator stands exactly between the end of a document and the next one's start
                crossings += 1
                assert origin[after][0] == origin[before][0] + 1 and origin[after][1] == 0
                assert origin[before][1] == len(lengths[origin[before][0]]) - 1
        words = [t for t in body if t != SEP]
        assert body.count(SEP) == len({origin[t][0] for t in words}) - 1  # one per document boundary inside
    assert crossings > len(examples) // 2  # most examples span two documents or more
    # every example but the last was closed because the sentence that follows it (with its separator when it
    # starts a document) did not fit
    for example, following in zip(examples, bodies[1:]):
        document, sentence = origin[following[0]]
        needed = lengths[document][sentence] + (sentence == 0)
        assert len(example.tokens) + needed > max_seq_length
    assert sum(len(e.tokens) for e in examples[:-1]) / (len(examples) - 1) > 0.8 * max_seq_length


def test_a_sentence_longer_than_an_example_is_cut_into_full_examples():
    documents, _ = numbered_documents([[3], [30, 2]])
    examples = [e.tokens for e in pack_full_sentences(documents, 12, CLS, SEP)]
    body = list(range(13, 43))  # the long sentence
    assert examples == [[CLS, 10, 11, 12, SEP], [CLS, *body[:10], SEP], [CLS, *body[10:20], SEP],
                        [CLS, *body[20:30], SEP], [CLS, 43, 44, SEP]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("mlm-corpus") / "corpus.txt", documents=20, sentences=10)


@pytest.fixture(scope="module")
def data(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlm") / "data"
    prepare.prepare_dataset([corpus], str(out), vocab_size=120, max_seq_lengths=(16, 32), objective=MLM)
    return str(out)


@pytest.fixture(scope="module")
def nsp_data(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("nsp") / "data"
    prepare.prepare_dataset([corpus], str(out), vocab_size=120, max_seq_lengths=(16, 32))
    return str(out)


def test_prepare_data_mlm_writes_packed_examples_of_its_own_identity(data, nsp_data, corpus):
    mlm, nsp = ShardedDataset(os.path.join(data, "seq32")), ShardedDataset(os.path.join(nsp_data, "seq32"))
    assert (mlm.objective, nsp.objective) == (MLM, MLM_NSP)
    assert mlm.metadata["options"]["objective"] == MLM and mlm.metadata["fingerprint"] != nsp.metadata["fingerprint"]
    sep = mlm.special_ids["sep"]
    examples = [mlm[i] for i in range(len(mlm))]
    assert all(a_length == len(tokens) and label == 0 for tokens, a_length, label in examples)
    # 19 document boundaries (about 100 tokens a document): some inside an example, behind a [SEP]
    assert sum(int((tokens[1:-1] == sep).any()) for tokens, _, _ in examples) >= 3
    # every example but the last has no room for the longest sentence of the corpus (and a separator)
    tokenizer = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    with open(corpus, encoding="utf-8") as f:
        sentences = [tokenizer.encode(line.strip(), add_special_tokens=False).ids for line in f if line.strip()]
    assert all(len(tokens) + max(map(len, sentences)) + 1 > 32 for tokens, _, _ in examples[:-1])
    # the corpus's tokens in order, each once
    assert [t for tokens, _, _ in examples for t in tokens[1:-1] if t != sep] == [t for s in sentences for t in s]
    batch = PretrainingLoader(mlm, MaskingCollator(mlm.vocabulary(), next_sentence=False), 8, 8).step(0)[0]
    assert batch.keys() == {"input_ids", "attention_mask", "labels"}  # one segment (token type 0), no NSP label
    # the objective is the dataset's identity: the other one into the same directory names both
    with pytest.raises(ValueError, match="objective: 'mlm' then, 'mlm\\+nsp' now"):
        prepare.prepare_dataset([corpus], data, vocab_size=120, max_seq_lengths=(32,))
    with pytest.raises(ValueError, match="--dupe-factor must be 1 with --objective mlm, got 2"):
        prepare.prepare_dataset([corpus], data, max_seq_lengths=(32,), objective=MLM, dupe_factor=2)


def test_prepare_data_mlm_takes_a_single_document_and_the_flag(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "one.txt", documents=1, sentences=30)
    assert prepare.main(["--corpus", corpus, "--out", str(tmp_path / "data"), "--vocab-size", "120",
                         "--max-seq-length", "32", "--objective", "mlm", "--workers", "1"]) == 0
    assert ShardedDataset(str(tmp_path / "data" / "seq32")).objective == MLM
    assert prepare.main(["--corpus", corpus, "--out", str(tmp_path / "nsp"), "--vocab-size", "120",
                         "--max-seq-length", "32", "--workers", "1"]) != 0
    assert "next sentence prediction needs at least 2" in capsys.readouterr().err


def config(data, out, **changes):
    values = dict(data=data, out=str(out), model="tiny", steps=6, batch_size=8, seq_lengths="16,32",
                  phase_fractions="0.5,0.5", log_every=1, progress=False, peak_tflops=1.0, device="cpu", lr=1e-3,
                  objective=MLM)
    return pretrain.PretrainConfig(**{**values, **changes})


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_mlm_pretraining_learns_without_nsp(data, tmp_path, monkeypatch, caplog, architecture):
    if architecture == "bert":
        model, overrides, trained, hf_class = "tiny", {**SMALL, **NO_DROPOUT}, BertForMaskedLM, "BertForMaskedLM"
    else:
        model, overrides = roberta_model(tmp_path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), {}
        trained, hf_class = RobertaForMaskedLM, "RobertaForMaskedLM"
    budgets, step = [], pretrain.train_step
    monkeypatch.setattr(pretrain, "train_step",
                        lambda run, *args: budgets.append(run.model.config.max_predictions_per_seq) or step(run, *args))
    out = tmp_path / "run"
    caplog.set_level(logging.INFO, "fastbert.train")
    result = pretrain.train(config(data, out, model=model, steps=24, seq_lengths="16", phase_fractions="1", lr=5e-3,
                                   warmup=2), overrides)
    assert type(result["model"]) is trained
    assert f"pretraining {'BERT' if architecture == 'bert' else 'RoBERTa'} (mlm, {trained.__name__}; " in caplog.text
    assert budgets == [3] * 24  # the static label budget: ceil(0.15 x 16) rows per sequence, whatever the batch
    lines = records(out)
    assert [r["step"] for r in lines] == list(range(1, 25))
    assert all(not NSP_KEYS & r.keys() and r["loss"] == r["mlm_loss"] and 0 <= r["mlm_accuracy"] <= 1
               and 0 <= r["mlm_mask_accuracy"] <= 1 for r in lines)
    first, last = (sum(r["loss"] for r in part) / 4 for part in (lines[:4], lines[-4:]))
    assert last < first - 0.5
    # the checkpoint is a masked-LM model that transformers loads: no pooler, no NSP head, nothing missing
    model_dir = os.path.join(out, "checkpoints", "step_00000024", "model")
    assert not any("pooler" in k or "seq_relationship" in k for k in read_state_dict(model_dir))
    for load in (trained.from_pretrained, getattr(transformers, hf_class).from_pretrained):
        _, info = load(model_dir, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]


TINY = {"vocab_size": 120, "pad_token_id": 0, "max_position_embeddings": 64}
OTHER_ARCHITECTURES = {  # transformers' config with tiny sizes, and fastbert's masked-LM class for it
    "DistilBertForMaskedLM": transformers.DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, **TINY),
    "MPNetForMaskedLM": transformers.MPNetConfig(**{**SMALL, **TINY}),
    "ElectraForMaskedLM": transformers.ElectraConfig(embedding_size=16, **{**SMALL, **TINY}),
    "XLMRobertaForMaskedLM": transformers.XLMRobertaConfig(**{**SMALL, **TINY}),
    "CamembertForMaskedLM": transformers.CamembertConfig(**{**SMALL, **TINY})}


@pytest.mark.parametrize("name", OTHER_ARCHITECTURES)  # MPNet's padding index is its own 1, the data pads with 0
def test_every_architectures_masked_lm_trains_on_packed_sentences(data, tmp_path, name):
    """Models without token types (DistilBERT, MPNet) too: an mlm batch is one segment and passes none."""
    OTHER_ARCHITECTURES[name].to_json_file(tmp_path / "config.json")
    result = pretrain.train(config(data, tmp_path / "run", model=str(tmp_path / "config.json"), steps=2), {})
    assert type(result["model"]).__name__ == name and result["step"] == 2
    assert all(np.isfinite(r["loss"]) and not NSP_KEYS & r.keys() for r in records(tmp_path / "run"))


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_mlm_resume_is_bitwise_exact(data, tmp_path, architecture):
    model, overrides = ("tiny", SMALL) if architecture == "bert" else (roberta_model(tmp_path), {})
    whole = tmp_path / "whole"
    pretrain.train(config(data, whole, model=model), overrides)
    parts = tmp_path / "parts"
    first = pretrain.train(config(data, parts, stop_at=2, model=model), overrides)  # inside the first phase
    assert first["stopped"] and first["step"] == 2
    second = pretrain.train(config(data, parts, model=model), overrides)
    assert second["step"] == 6 and second["model"].config.max_predictions_per_seq == 0
    computed = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records(whole)]
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records(parts)] == computed
    final_whole, final_parts = (read_state_dict(os.path.join(out, "checkpoints", "step_00000006", "model"))
                                for out in (whole, parts))
    assert final_whole.keys() == final_parts.keys()
    assert all(torch.equal(final_whole[k], final_parts[k]) for k in final_whole)


def test_each_objective_refuses_the_others_data_and_checkpoint(data, nsp_data, tmp_path):
    with pytest.raises(ValueError, match=r"prepared for --objective mlm\+nsp, this run's --objective is mlm"):
        pretrain.train(config(nsp_data, tmp_path / "a"), SMALL)
    with pytest.raises(ValueError, match=r"prepared for --objective mlm, this run's --objective is mlm\+nsp"):
        pretrain.train(config(data, tmp_path / "b", objective=MLM_NSP), SMALL)
    out = tmp_path / "run"
    pretrain.train(config(data, out, stop_at=1), SMALL)
    with pytest.raises(ValueError, match=r"--objective: checkpoint 'mlm', now 'mlm\+nsp'"):
        pretrain.train(config(nsp_data, out, objective=MLM_NSP), SMALL)


def test_a_checkpoint_of_another_architecture_is_not_resumed(data, tmp_path):
    out = tmp_path / "run"
    pretrain.train(config(data, out, stop_at=1), {**SMALL, "max_position_embeddings": 34})
    with pytest.raises(ValueError, match="differs in shape \\(--model.model_type: checkpoint 'bert', now 'roberta'"):
        pretrain.train(config(data, out, model=roberta_model(tmp_path), accept_changes=True), {})


@pytest.mark.parametrize("before,after", [(MLM_NSP, MLM), (MLM, MLM_NSP)])
def test_accept_changes_goes_on_under_the_other_objective(data, nsp_data, tmp_path, caplog, monkeypatch, before,
                                                         after):
    datasets = {MLM: data, MLM_NSP: nsp_data}
    out = tmp_path / "run"
    first = pretrain.train(config(datasets[before], out, stop_at=2, objective=before), SMALL)
    saved = read_state_dict(os.path.join(first["checkpoint"], "model"))
    seen, load = {}, dcp_state_dict.set_model_state_dict

    def keep_loaded(model, state_dict, **kwargs):  # what the resume loads into the model
        seen.update(state_dict)
        return load(model, state_dict, **kwargs)

    monkeypatch.setattr(dcp_state_dict, "set_model_state_dict", keep_loaded)
    second = pretrain.train(config(datasets[after], out, objective=after, accept_changes=True), SMALL)
    assert second["step"] == 6 and not second["stopped"]
    assert f"resuming with a change (--accept-changes): --objective: checkpoint '{before}', now '{after}'" \
        in caplog.text
    assert f"the checkpoint's run trained --objective {before}" in caplog.text
    assert seen.keys() == saved.keys()  # the checkpoint's weights, the other objective's head among them
    nsp_only = {k for k in second["model"].state_dict() if k.startswith(("bert.pooler.", "cls.seq_relationship."))}
    assert bool(nsp_only) == (after == MLM_NSP)
    lines = records(out)
    assert [r["step"] for r in lines] == list(range(1, 7))
    assert all(NSP_KEYS <= r.keys() if (r["step"] > 2) == (after == MLM_NSP) else not NSP_KEYS & r.keys()
               for r in lines)


def roberta_model(directory, **changes):
    """A RoBERTa-type --model: transformers' RobertaConfig with tiny sizes, for the test data's vocabulary
    (WordPiece, [PAD] = 0); positions start after padding_idx, so the table is 2 longer than the data's 32."""
    path = os.path.join(directory, "roberta.json")
    sizes = {"vocab_size": 120, "pad_token_id": 0, "max_position_embeddings": 34, "type_vocab_size": 1,
             **{k: v for k, v in SMALL.items() if k != "max_position_embeddings"}}
    transformers.RobertaConfig(**{**sizes, **changes}).to_json_file(path)
    return path


def test_nsp_needs_a_bert_model(data, nsp_data, tmp_path):
    with pytest.raises(ValueError, match="got model_type 'roberta'.*use --objective mlm"):
        pretrain.train(config(nsp_data, tmp_path / "a", objective=MLM_NSP, model=roberta_model(tmp_path)), {})
    assert run.model_class(RobertaConfig(), MLM) is RobertaForMaskedLM
    assert run.model_class(BertConfig(), MLM) is BertForMaskedLM
    assert run.model_class(BertConfig(), MLM_NSP) is BertForPreTraining


def test_masks_are_drawn_anew_every_epoch_from_the_seed(data):
    dataset = ShardedDataset(os.path.join(data, "seq32"))
    collator = MaskingCollator(dataset.vocabulary(), next_sentence=False)
    n = len(dataset)

    def epochs(seed):
        """{example index: labels} of epochs 0 and 1, the whole dataset as one step each."""
        loader = PretrainingLoader(dataset, collator, n, n, seed=seed)
        result = []
        for epoch in range(2):
            indices, _ = loader.examples(epoch * n + np.arange(n))
            labels = loader.step(epoch * n)[0]["labels"]
            result.append({int(i): row for i, row in zip(indices, labels)})
        return result

    first, second = epochs(5)
    differ = [i for i in range(n) if not torch.equal(first[i], second[i])]
    assert len(differ) > 0.9 * n  # the same example, another mask in the next epoch
    again = epochs(5)
    assert all(torch.equal(a[i], b[i]) for a, b in zip(again, (first, second)) for i in range(n))  # seeded
    other = epochs(6)[0]
    assert sum(not torch.equal(other[i], first[i]) for i in range(n)) > 0.9 * n


def test_help_names_the_objective(capsys):
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--objective {mlm+nsp,mlm}" in text and "(default: 'mlm+nsp')" in text


def test_modernbert_preset_pretrains_and_resumes_bitwise(data, tmp_path):
    """--model modernbert-base with the sizes cut down by --model.<field> (ModernBERT's own fields included):
    its masked LM trains on packed sentences with the data's padding id and resumes bitwise."""
    from fastbert.modernbert import ModernBertForMaskedLM
    overrides = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
                 "local_attention": 8, "max_position_embeddings": 64}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    result = pretrain.train(config(data, whole, model="modernbert-base"), overrides)
    assert type(result["model"]) is ModernBertForMaskedLM and result["model"].config.pad_token_id == 0
    assert result["model"].config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert pretrain.train(config(data, parts, stop_at=2, model="modernbert-base"), overrides)["stopped"]
    # ModernBERT's own fields are the run's too, under either spelling (norm_eps is its config.json's layer_norm_eps):
    # a resume that changes one is refused naming it, where it went on with other numbers
    for change, named in (({"local_attention": 4}, "--model.local_attention: checkpoint 8, now 4"),
                          ({"norm_eps": 0.5}, "--model.layer_norm_eps: checkpoint 1e-05, now 0.5")):
        with pytest.raises(ValueError, match=re.escape(named)):
            pretrain.train(config(data, parts, model="modernbert-base"), {**overrides, **change})
    pretrain.train(config(data, parts, model="modernbert-base"), overrides)
    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records(whole)]
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records(parts)] == strip
    assert all(np.isfinite(r["loss"]) and not NSP_KEYS & r.keys() for r in strip)
    final_whole, final_parts = (read_state_dict(os.path.join(out, "checkpoints", "step_00000006", "model"))
                                for out in (whole, parts))
    assert final_whole.keys() == final_parts.keys()
    assert all(torch.equal(final_whole[k], final_parts[k]) for k in final_whole)
    with pytest.raises(ValueError, match=r"--model.no_such_field: ModernBertConfig has no field"):
        pretrain.train(config(data, tmp_path / "bad", model="modernbert-base"), {"no_such_field": 1})
