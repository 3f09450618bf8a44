"""Pretraining data: corpus reading and its errors, the paper's NSP examples, shards, masking, the loader."""
import json
import os
import random

import numpy as np
import pytest
import torch

from fastbert.data import corpus, prepare
from fastbert.data.examples import IS_NEXT, RANDOM_NEXT, create_examples
from fastbert.data.loader import PretrainingLoader, prefetch
from fastbert.data.masking import IGNORE_INDEX, MaskingCollator, example_seed
from fastbert.data.shards import ShardedDataset, write_index, write_shard
from fastbert.data.tokenizer import SPECIAL_TOKENS

CLS, SEP = 2, 3
WORDS = ("the cat sat on a mat while dogs ran across green fields and birds sang songs about rivers "
         "mountains cities people built houses near lakes where children played games every summer").split()


def write_corpus(path, documents=6, sentences=8, seed=0):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for d in range(documents):
            for _ in range(sentences):
                f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ".\n")
            f.write("\n")
    return str(path)


# corpus ---------------------------------------------------------------------------------------------
def test_text_and_jsonl_documents(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("One.\nTwo.\n\n\nThree.\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "Four five. Six!\nSeven"}) + "\n\n" + json.dumps({"text": "Eight."}) + "\n")
    docs = list(corpus.read_documents([str(text), str(jsonl)]))
    assert docs == [["One.", "Two."], ["Three."], ["Four five.", "Six!", "Seven"], ["Eight."]]


def test_stdlib_corpus_reads_docstrings():
    assert len(corpus.stdlib_files()) > 100
    first = next(corpus.read_documents(["stdlib"]))
    assert first and all(isinstance(s, str) and s for s in first)


# file name and bytes of each bad corpus ("missing": the file is not written)
BAD_CORPORA = {"missing": ("c.txt", None), "empty": ("c.txt", b"\n\n"),
               "undecodable": ("c.txt", b"good line\nbad \xff\xfe line\n"),
               "bad_jsonl": ("c.jsonl", b'{"text": "ok"}\nnot json\n'),
               "no_text_field": ("c.jsonl", b'{"body": "ok"}\n'),
               "single_document": ("c.txt", b"Only one document here.\nWith two sentences.\n")}


def bad_corpus(tmp_path, case):
    name, content = BAD_CORPORA[case]
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("case", ["missing", "empty", "undecodable", "bad_jsonl", "no_text_field"])
def test_bad_corpus_errors_name_the_file(tmp_path, case):
    path = bad_corpus(tmp_path, case)
    with pytest.raises(corpus.CorpusError) as info:
        list(corpus.read_documents([str(path)]))
    assert str(path) in str(info.value)
    if case == "undecodable":
        assert ":2:" in str(info.value) and "--encoding-errors" in str(info.value)
        docs = list(corpus.read_documents([str(path)], encoding_errors="replace"))
        assert docs == [["good line", "bad \ufffd\ufffd line"]]


@pytest.mark.parametrize("case", ["missing", "empty", "undecodable", "single_document"])
def test_prepare_data_bad_corpus_is_a_clear_error(tmp_path, capsys, case):
    path = bad_corpus(tmp_path, case)
    rc = prepare.main(["--corpus", str(path), "--out", str(tmp_path / "out"), "--vocab-size", "50"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("fastbert prepare-data: error:") and "Traceback" not in err
    expected = {"missing": "does not exist", "empty": "contains no text", "undecodable": "not valid UTF-8",
                "single_document": "at least 2"}[case]
    assert expected in err
    assert not os.path.exists(tmp_path / "out" / "seq128")


# examples -------------------------------------------------------------------------------------------
def synthetic_documents(count=60, seed=0):
    """Token t = 10 + 1000 * document + position in the document: every token says where it came from."""
    rng = random.Random(seed)
    documents = []
    for d in range(count):
        position, sentences = 0, []
        for _ in range(rng.randint(1, 30)):
            n = rng.randint(1, 25)
            sentences.append([10 + 1000 * d + position + i for i in range(n)])
            position += n
        documents.append(sentences)
    return documents


@pytest.mark.parametrize("max_seq_length", [32, 128])
def test_nsp_examples_layout_and_balance(max_seq_length):
    examples = create_examples(synthetic_documents(), max_seq_length, 0.1, 3, CLS, SEP, random.Random(1))
    assert len(examples) > 400
    random_next = sum(e.next_sentence_label == RANDOM_NEXT for e in examples) / len(examples)
    assert abs(random_next - 0.5) < 0.05  # B is the actual next text half of the time
    full = 0
    for e in examples:
        tokens = e.tokens
        assert len(tokens) <= max_seq_length
        assert tokens[0] == CLS and tokens[e.a_length - 1] == SEP and tokens[-1] == SEP
        a, b = tokens[1:e.a_length - 1], tokens[e.a_length:-1]
        assert a and b and CLS not in a + b and SEP not in a + b
        docs_a, docs_b = {(t - 10) // 1000 for t in a}, {(t - 10) // 1000 for t in b}
        assert len(docs_a) == 1 and len(docs_b) == 1
        assert a == sorted(a) and b == sorted(b)  # contiguous runs in document order (up to truncation)
        if e.next_sentence_label == IS_NEXT:
            assert docs_a == docs_b and b[0] > a[-1]
        else:
            assert docs_a != docs_b
        full += len(tokens) >= max_seq_length - 8
    assert full > 0.3 * len(examples)  # most chunks fill the target length; short_seq_prob makes some shorter


def test_single_document_is_rejected():
    with pytest.raises(ValueError, match="at least 2 documents"):
        create_examples(synthetic_documents(1), 32, 0.1, 1, CLS, SEP, random.Random(0))


# shards ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [1000, 70000])
def test_shard_round_trip(tmp_path, vocab_size):
    examples = create_examples(synthetic_documents(20), 64, 0.1, 1, CLS, SEP, random.Random(2))
    for e in examples:
        e.tokens = [t % vocab_size if t not in (CLS, SEP) else t for t in e.tokens]
    entries = [write_shard(str(tmp_path), f"shard_{i:05d}", part, vocab_size)
               for i, part in enumerate((examples[:7], [], examples[7:]))]
    write_index(str(tmp_path), {"max_seq_length": 64, "vocab_size": vocab_size, "shards": entries,
                                "special_ids": {"pad": 0, "unk": 1, "cls": CLS, "sep": SEP, "mask": 4}})
    dataset = ShardedDataset(str(tmp_path))
    assert len(dataset) == len(examples)
    for i, e in enumerate(examples):
        tokens, a_length, label = dataset[i]
        assert tokens.tolist() == e.tokens and a_length == e.a_length and label == e.next_sentence_label
    with pytest.raises(IndexError):
        dataset[len(examples)]
    with open(tmp_path / "shard_00002.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="do not match"):
        ShardedDataset(str(tmp_path))
    os.remove(tmp_path / "index.json")
    with pytest.raises(ValueError, match="prepare-data"):
        ShardedDataset(str(tmp_path))


def test_prepare_data_end_to_end(tmp_path):
    path = write_corpus(tmp_path / "c.txt", documents=11)  # chunks of 5, 5 and 1: the 1 joins the 2nd
    out = tmp_path / "data"
    assert prepare.main(["--corpus", path, "--out", str(out), "--vocab-size", "120", "--max-seq-length", "24", "48",
                         "--docs-per-chunk", "5"]) == 0
    for length in (24, 48):
        dataset = ShardedDataset(str(out / f"seq{length}"))
        assert dataset.max_seq_length == length and len(dataset.metadata["shards"]) == 2
        assert dataset.vocabulary()[:5] == list(SPECIAL_TOKENS) and dataset.vocab_size <= 120
        assert max(len(dataset[i][0]) for i in range(len(dataset))) <= length
    assert not [n for n in os.listdir(out) if n.startswith(".tmp")]
    # a given vocab.txt is used as it is
    again = tmp_path / "again"
    assert prepare.main(["--corpus", path, "--out", str(again), "--tokenizer", str(out / "vocab.txt"),
                         "--max-seq-length", "24", "--docs-per-chunk", "5"]) == 0
    first, second = ShardedDataset(str(out / "seq24")), ShardedDataset(str(again / "seq24"))
    assert first.vocabulary() == second.vocabulary() and len(first) == len(second)
    # existing output is not overwritten silently
    assert prepare.main(["--corpus", path, "--out", str(out), "--max-seq-length", "24"]) == 2


# masking --------------------------------------------------------------------------------------------
def vocabulary(size=600):
    return list(SPECIAL_TOKENS) + [f"##p{i}" if i % 3 == 0 else f"w{i}" for i in range(size - len(SPECIAL_TOKENS))]


def random_examples(count, rng, vocab_size, low=8, high=120):
    examples = []
    for _ in range(count):
        n = int(rng.integers(low, high))
        a = int(rng.integers(2, n - 1))
        tokens = rng.integers(5, vocab_size, n)
        tokens[0], tokens[a - 1], tokens[-1] = CLS, SEP, SEP
        examples.append((tokens.astype(np.int64), a, int(rng.integers(0, 2))))
    return examples


def test_masking_statistics():
    vocab = vocabulary()
    collator = MaskingCollator(vocab)
    rng = np.random.default_rng(0)
    examples = random_examples(2000, rng, len(vocab))
    batch = collator(examples, [example_seed(7, i) for i in range(len(examples))])
    original = torch.full_like(batch["input_ids"], 0)
    for row, (tokens, _, _) in enumerate(examples):
        original[row, :len(tokens)] = torch.from_numpy(tokens)
    special = (original == CLS) | (original == SEP) | (batch["attention_mask"] == 0)
    chosen = batch["labels"] != IGNORE_INDEX
    candidates = int((~special).sum())
    assert candidates > 100_000
    assert not (chosen & special).any() and torch.equal(batch["input_ids"][special], original[special])
    assert abs(int(chosen.sum()) / candidates - 0.15) < 0.005
    assert torch.equal(batch["labels"][chosen], original[chosen])
    n = int(chosen.sum())
    masked = int((batch["input_ids"][chosen] == collator.mask_id).sum()) / n
    unchanged = int((batch["input_ids"][chosen] == original[chosen]).sum()) / n
    assert abs(masked - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 and abs(1 - masked - unchanged - 0.1) < 0.01
    assert torch.equal(batch["token_type_ids"][0, :examples[0][1]], torch.zeros(examples[0][1], dtype=torch.int64))
    assert batch["token_type_ids"][0, examples[0][1]:len(examples[0][0])].eq(1).all()
    assert batch["input_ids"].shape[1] % 8 == 0
    assert batch["next_sentence_label"].tolist() == [e[2] for e in examples]


def test_masks_depend_only_on_the_seed():
    vocab = vocabulary()
    collator = MaskingCollator(vocab)
    examples = random_examples(6, np.random.default_rng(1), len(vocab))
    seeds = [example_seed(3, 0, i) for i in range(6)]
    whole = collator(examples, seeds)
    assert all(torch.equal(whole[k], v) for k, v in collator(examples, seeds).items())
    for row in (0, 5):  # alone in its batch, an example gets the same mask
        alone = collator([examples[row]], [seeds[row]])
        n = len(examples[row][0])
        assert torch.equal(alone["input_ids"][0, :n], whole["input_ids"][row, :n])
        assert torch.equal(alone["labels"][0, :n], whole["labels"][row, :n])
    other = collator(examples, [s + 1 for s in seeds])
    assert not torch.equal(other["labels"], whole["labels"])


def test_whole_word_masking_masks_whole_words():
    vocab = vocabulary()
    collator = MaskingCollator(vocab, whole_word=True)
    examples = random_examples(400, np.random.default_rng(2), len(vocab), low=30)
    batch = collator(examples, list(range(400)))
    chosen = batch["labels"] != IGNORE_INDEX
    continuation = collator.continuation
    for row, (tokens, _, _) in enumerate(examples):
        ids = torch.from_numpy(tokens)
        candidate = (ids != CLS) & (ids != SEP)
        budget = max(1, round(int(candidate.sum()) * 0.15))
        picked = chosen[row, :len(tokens)]
        assert 1 <= int(picked.sum())
        for i in range(1, len(tokens)):  # a "##" piece and the token before it share their fate
            if continuation[ids[i]] and candidate[i - 1] and candidate[i]:
                assert picked[i] == picked[i - 1]
        words = [0]
        for i in range(len(tokens)):
            if candidate[i] and picked[i]:
                words[-1] += 1
            elif words[-1]:
                words.append(0)
        assert int(picked.sum()) <= budget or len([w for w in words if w]) == 1


# loader ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    examples = create_examples(synthetic_documents(30), 40, 0.1, 1, CLS, SEP, random.Random(3))
    for e in examples:
        e.tokens = [t % 590 + 5 if t not in (CLS, SEP) else t for t in e.tokens]
    entries = [write_shard(str(out), "shard_00000", examples, 600)]
    write_index(str(out), {"max_seq_length": 40, "vocab_size": 600, "shards": entries,
                           "special_ids": {"pad": 0, "unk": 1, "cls": CLS, "sep": SEP, "mask": 4}})
    with open(out / "vocab.txt", "w") as f:
        f.writelines(t + "\n" for t in vocabulary())
    return ShardedDataset(str(out))


def test_ranks_split_the_global_batch(dataset):
    collator = MaskingCollator(dataset.vocabulary())
    single = PretrainingLoader(dataset, collator, 8, 8, seed=5)
    ranks = [PretrainingLoader(dataset, collator, 8, 2, rank=r, world_size=2, seed=5) for r in range(2)]
    for position in (0, 8, len(dataset) - 4):  # the last one spans two epochs
        whole = single.step(position)[0]
        parts = [mb for loader in ranks for mb in loader.step(position)]
        assert len(parts) == 4 and all(mb["input_ids"].shape[0] == 2 for mb in parts)
        for k in ("input_ids", "labels", "next_sentence_label"):
            rows = [row[row != 0] if k == "input_ids" else row for mb in parts for row in mb[k]]
            expected = [row[row != 0] if k == "input_ids" else row for row in whole[k]]
            if k == "labels":
                rows = [r[r != IGNORE_INDEX] for r in rows]
                expected = [r[r != IGNORE_INDEX] for r in expected]
            assert all(torch.equal(a, b) for a, b in zip(rows, expected))
    with pytest.raises(ValueError, match="multiple"):
        PretrainingLoader(dataset, collator, 6, 4, world_size=1)


def test_epochs_cover_the_dataset_and_reshuffle(dataset):
    loader = PretrainingLoader(dataset, MaskingCollator(dataset.vocabulary()), 4, 4, seed=1)
    n = len(dataset)
    assert sorted(loader.permutation(0).tolist()) == list(range(n))
    assert not np.array_equal(loader.permutation(0), loader.permutation(1))
    stream = prefetch(loader.steps(0), depth=2)
    first = [next(stream) for _ in range(3)]
    resumed = next(prefetch(loader.steps(8), depth=2))  # a stream restarted at position 8 is step 3's
    assert all(torch.equal(resumed[0][k], first[2][0][k]) for k in resumed[0])
    stream.close()
