"""Pretraining data: corpus reading and its errors, the paper's NSP examples, shards, masking, the loader."""
import json
import os
import random

import numpy as np
import pytest
import torch

from fastbert.data import corpus, prepare
from fastbert.data.examples import IS_NEXT, RANDOM_NEXT, create_examples
from fastbert.data.loader import PretrainingLoader, ShardReader, permute, prefetch
from fastbert.data.masking import IGNORE_INDEX, ExampleBatch, MaskingCollator, hash_keys, mix_in, stream_draws
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
    assert err.splitlines()[-1].startswith("fastbert prepare-data: error:") and "Traceback" not in err
    expected = {"missing": "does not exist", "empty": "contains no text", "undecodable": "c.txt:2: byte 4 of the "
                "line is not valid UTF-8", "single_document": "at least 2"}[case]
    assert expected in err.splitlines()[-1]
    assert not os.path.exists(tmp_path / "out")  # nothing left of a new --out (the one document: its tokenizer was)


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
    path = write_corpus(tmp_path / "c.txt", documents=11)
    out = tmp_path / "data"
    chunks = len(corpus.plan_chunks([path], 1024))
    assert chunks >= 3
    assert prepare.main(["--corpus", path, "--out", str(out), "--vocab-size", "120", "--max-seq-length", "24", "48",
                         "--chunk-bytes", "1K"]) == 0
    for length in (24, 48):
        dataset = ShardedDataset(str(out / f"seq{length}"))
        assert dataset.max_seq_length == length and len(dataset.metadata["shards"]) == chunks
        assert dataset.vocabulary()[:5] == list(SPECIAL_TOKENS) and dataset.vocab_size <= 120
        assert max(len(dataset[i][0]) for i in range(len(dataset))) <= length
        assert dataset.metadata["documents"] == 11
    # no lock file beside
    assert sorted(os.listdir(out)) == ["prepare-data.json", "seq24", "seq48", "tokenizer.json", "vocab.txt"]
    # a given vocab.txt is used as it is
    again = tmp_path / "again"
    assert prepare.main(["--corpus", path, "--out", str(again), "--tokenizer", str(out / "vocab.txt"),
                         "--max-seq-length", "24", "--chunk-bytes", "1K"]) == 0
    first, second = ShardedDataset(str(out / "seq24")), ShardedDataset(str(again / "seq24"))
    assert first.vocabulary() == second.vocabulary() and len(first) == len(second)
    # existing output made with other options is not overwritten silently
    assert prepare.main(["--corpus", path, "--out", str(out), "--max-seq-length", "24"]) == 2


def prepare_data(capsys, corpus_path, out, *options):
    """`fastbert prepare-data` on a small corpus: (exit code, stderr)."""
    rc = prepare.main(["--corpus", corpus_path, "--out", str(out), "--max-seq-length", "24", "--workers", "1",
                       *options])
    return rc, capsys.readouterr().err


def test_prepare_data_refuses_an_out_holding_other_files(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "vocab.txt").write_text("my precious vocab\n")
    (mine / "notes.md").write_text("notes\n")
    rc, err = prepare_data(capsys, path, mine, "--vocab-size", "120")
    assert rc == 2 and f"--out {mine} holds files that `fastbert prepare-data` did not write (notes.md, vocab.txt;" \
        in err.splitlines()[-1]
    assert sorted(os.listdir(mine)) == ["notes.md", "vocab.txt"]
    assert (mine / "vocab.txt").read_text() == "my precious vocab\n"  # nothing written
    # a stray tokenizer.json is not taken for the tokenizer of datasets that are not there
    assert prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "120")[0] == 0
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "tokenizer.json").write_text((tmp_path / "data" / "tokenizer.json").read_text())
    rc, err = prepare_data(capsys, path, stray, "--vocab-size", "120")
    assert rc == 2 and f"--out {stray} holds files" in err and "(tokenizer.json;" in err
    assert os.listdir(stray) == ["tokenizer.json"]
    # an empty directory is taken; so is a prepare-data output whose first run stopped before its datasets
    empty = tmp_path / "empty"
    empty.mkdir()
    one = write_corpus(tmp_path / "one.txt", documents=1)
    assert prepare_data(capsys, one, empty, "--vocab-size", "120")[0] == 2
    assert "tokenizer.json" in os.listdir(empty)  # the directory was the user's: what the run wrote stays
    assert prepare_data(capsys, path, empty, "--vocab-size", "120")[0] == 0


def test_prepare_data_out_below_a_file_names_the_flag_and_the_file(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt")
    rc, err = prepare_data(capsys, path, tmp_path / "c.txt" / "sub")
    assert rc == 2 and err.splitlines()[-1] == \
        f"fastbert prepare-data: error: --out {tmp_path / 'c.txt' / 'sub'}: {tmp_path / 'c.txt'} is a file, so " \
        "nothing can be written under it"
    rc, err = prepare_data(capsys, path, tmp_path / "c.txt")
    assert rc == 2 and f"--out {tmp_path / 'c.txt'} is a file; --out names the output directory" in err


def test_prepare_data_says_a_given_tokenizer_ignores_cased_and_vocab_size(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt")
    assert prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "120")[0] == 0
    given = tmp_path / "data" / "tokenizer.json"  # lower-cases: a tokenizer.json keeps its own normaliser
    size = len(ShardedDataset(str(tmp_path / "data" / "seq24")).vocabulary())
    rc, err = prepare_data(capsys, path, tmp_path / "k1", "--tokenizer", str(given), "--cased", "--vocab-size", "999")
    assert rc == 0
    assert f"tokenizer: {given} ({size} tokens) (ignored with --tokenizer {given}: --vocab-size 999, --cased)" in err
    # options the tokenizer does follow are not named: a vocab.txt is read cased with --cased
    rc, err = prepare_data(capsys, path, tmp_path / "k2", "--tokenizer", str(tmp_path / "data" / "vocab.txt"),
                           "--cased", "--vocab-size", str(size))
    assert rc == 0 and "ignored" not in err
    assert json.loads((tmp_path / "k2" / "tokenizer.json").read_text())["normalizer"]["lowercase"] is False


def test_prepare_data_reports_a_smaller_vocabulary_and_an_identical_rerun_hears_nothing(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt")
    rc, err = prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "500")
    size = len(ShardedDataset(str(tmp_path / "data" / "seq24")).vocabulary())
    assert rc == 0 and size < 500
    assert f"vocabulary: {size} tokens (fewer than --vocab-size 500: the text it was trained on has no more)" in err
    rc, err = prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "500")
    assert rc == 0 and "as for this directory's other datasets" in err and "ignored" not in err
    rc, err = prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "600")  # another size is still named
    assert rc == 0 and "(ignored here, for a new --out: --vocab-size 600)" in err


@pytest.mark.parametrize("option, value, message", [
    ("--dupe-factor", "0", "--dupe-factor must be >= 1, got 0"),
    ("--chunk-bytes", "1", "--chunk-bytes must be >= 1024, got 1"),
    ("--vocab-sample-bytes", "10", "--vocab-sample-bytes must be >= 1024, got 10"),
    ("--workers", "0", "--workers must be >= 1, got 0"),
    ("--vocab-size", "5", "--vocab-size must be larger than the 5 special tokens, got 5"),
    ("--short-seq-prob", "nan", "--short-seq-prob must be in [0, 1], got nan"),
    ("--max-seq-length", "4", "--max-seq-length must be in [5, 65535], got 4"),
])
def test_prepare_data_limits_name_the_flags(tmp_path, capsys, option, value, message):
    path = write_corpus(tmp_path / "c.txt")
    rc, err = prepare_data(capsys, path, tmp_path / "data", option, value)
    assert rc == 2 and err.splitlines()[-1] == f"fastbert prepare-data: error: {message}"
    assert not os.path.exists(tmp_path / "data")


def test_a_tokenizer_directory_is_named_as_a_directory(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt")
    assert prepare_data(capsys, path, tmp_path / "data", "--vocab-size", "120")[0] == 0
    rc, err = prepare_data(capsys, path, tmp_path / "again", "--tokenizer", str(tmp_path / "data"))
    assert rc == 2 and f"tokenizer file '{tmp_path / 'data'}' is a directory; give a tokenizer.json or vocab.txt " \
        f"file, such as {tmp_path / 'data' / 'tokenizer.json'}" in err


def test_chunks_end_at_document_boundaries_and_cut_only_long_documents(tmp_path):
    """Every chunk holds whole documents, and the chunks together hold the corpus; a document longer
    than a quarter of a chunk is cut at a line; a .jsonl line is never cut."""
    short = write_corpus(tmp_path / "short.txt", documents=40, sentences=6)
    long_document = tmp_path / "book.txt"
    long_document.write_text("".join(f"sentence {i} of one long book.\n" for i in range(400)))
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps({"text": f"Doc {i}. " * 20}) + "\n" for i in range(30)))
    paths = [short, str(long_document), str(lines)]
    plan = corpus.plan_chunks(paths, 2048)
    sizes = [sum(s.end - s.start for s in chunk) for chunk in plan]
    assert len(plan) >= 10 and max(sizes) <= 2048 * 1.25 + 100 and sum(sizes) == sum(map(os.path.getsize, paths))
    documents = [d for chunk in plan for s in chunk for d in corpus.segment_documents(s)]
    whole = list(corpus.read_documents(paths))
    book = [d for d in documents if d[0].startswith("sentence")]
    assert [s for d in book for s in d] == [s for d in whole if d[0].startswith("sentence") for s in d]
    assert len(book) > 1  # the book was cut into pieces at lines
    assert [d for d in documents if not d[0].startswith("sentence")] == [
        d for d in whole if not d[0].startswith("sentence")]  # every other document whole, in order


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


def padded(examples, width=None):
    """(tokens, a_length, label) examples as an ExampleBatch of `width` columns (default: the longest)."""
    lengths = np.array([len(tokens) for tokens, _, _ in examples])
    tokens = np.zeros((len(examples), width or lengths.max()), dtype=np.int64)
    for row, (ids, _, _) in enumerate(examples):
        tokens[row, :len(ids)] = ids
    return ExampleBatch(tokens, lengths, np.array([a for _, a, _ in examples]), np.array([n for _, _, n in examples]))


def masked(collator, batch, keys):
    return {name: torch.from_numpy(array) for name, array in collator(batch, keys).items()}


def splitmix64(seed, count):
    """Reference splitmix64 (Steele, Lea and Flood, 2014) in Python integers: its first `count` outputs."""
    outputs, state, mask = [], seed, (1 << 64) - 1
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        outputs.append(z ^ (z >> 31))
    return outputs


def test_draws_are_splitmix64_streams_of_the_example_keys():
    keys = hash_keys(3, 1, np.array([0, 0, 5]), np.array([7, 8, 7]))
    assert keys.dtype == np.uint64 and len(set(keys.tolist())) == 3  # each key input changes the hash
    assert hash_keys(3, 1, 0, 8)[0] == keys[1]  # scalars and arrays hash alike
    assert np.array_equal(mix_in(hash_keys(3, 1, 5)[0], np.array([7])), hash_keys(3, 1, 5, 7))  # keys mix in one by one
    draws = stream_draws(keys, 5)
    assert [draws[row].tolist() for row in range(3)] == [splitmix64(int(k), 5) for k in keys]


def test_masking_statistics():
    vocab = vocabulary()
    collator = MaskingCollator(vocab)
    rng = np.random.default_rng(0)
    examples = random_examples(2000, rng, len(vocab))
    batch = padded(examples)
    out = masked(collator, batch, hash_keys(7, np.arange(len(examples))))
    original = torch.from_numpy(batch.tokens)
    special = (original == CLS) | (original == SEP) | (out["attention_mask"] == 0)
    chosen = out["labels"] != IGNORE_INDEX
    candidates = int((~special).sum())
    assert candidates > 100_000
    assert not (chosen & special).any() and torch.equal(out["input_ids"][special], original[special])
    assert abs(int(chosen.sum()) / candidates - 0.15) < 0.005
    assert torch.equal(out["labels"][chosen], original[chosen])
    n = int(chosen.sum())
    replaced = out["input_ids"][chosen]
    shown_masked = int((replaced == collator.mask_id).sum()) / n
    unchanged = int((replaced == original[chosen]).sum()) / n
    assert abs(shown_masked - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01
    assert abs(1 - shown_masked - unchanged - 0.1) < 0.01
    random_tokens = replaced[(replaced != collator.mask_id) & (replaced != original[chosen])]
    # drawn uniformly from the whole vocabulary: mean (V - 1) / 2, standard error about V / sqrt(12 n)
    assert abs(random_tokens.double().mean() - (len(vocab) - 1) / 2) < 4 * len(vocab) / (12 * len(random_tokens)) ** 0.5
    assert int(random_tokens.min()) < 10 and int(random_tokens.max()) >= len(vocab) - 10
    lengths = torch.from_numpy(batch.lengths)
    assert torch.equal(out["attention_mask"].sum(1), lengths)
    a_length = examples[0][1]
    assert out["token_type_ids"][0, :a_length].eq(0).all() and out["token_type_ids"][0, a_length:lengths[0]].eq(1).all()
    assert out["token_type_ids"][0, lengths[0]:].eq(0).all()
    assert out["next_sentence_label"].tolist() == [e[2] for e in examples]
    assert all(v.dtype == torch.int64 for v in out.values())


@pytest.mark.parametrize("whole_word", [False, True])
def test_masks_depend_only_on_the_key(whole_word):
    vocab = vocabulary()
    collator = MaskingCollator(vocab, whole_word=whole_word)
    examples = random_examples(6, np.random.default_rng(1), len(vocab))
    keys = hash_keys(3, 0, 0, np.arange(6))
    whole = masked(collator, padded(examples), keys)
    assert all(torch.equal(whole[k], v) for k, v in masked(collator, padded(examples), keys).items())
    for row in (0, 5):  # alone in its batch and padded wider, an example gets the same mask
        alone = masked(collator, padded([examples[row]], width=200), keys[row:row + 1])
        n = len(examples[row][0])
        assert torch.equal(alone["input_ids"][0, :n], whole["input_ids"][row, :n])
        assert torch.equal(alone["labels"][0, :n], whole["labels"][row, :n])
    other = masked(collator, padded(examples), keys + np.uint64(1))
    assert not torch.equal(other["labels"], whole["labels"])


def test_whole_word_masking_masks_whole_words():
    vocab = vocabulary()
    collator = MaskingCollator(vocab, whole_word=True)
    examples = random_examples(400, np.random.default_rng(2), len(vocab), low=30)
    chosen = masked(collator, padded(examples), hash_keys(np.arange(400)))["labels"] != IGNORE_INDEX
    continuation = torch.from_numpy(collator.continuation)
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
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_epoch_permutation_is_a_bijection(size):
    image = permute(np.arange(size), size, key=9)
    assert sorted(image.tolist()) == list(range(size))
    if size >= 64:  # and a shuffle: neither the identity nor a shift, and another key gives another order
        assert (np.diff(image) == 1).mean() < 0.1 and abs(np.corrcoef(np.arange(size), image)[0, 1]) < 0.3
        assert not np.array_equal(image, permute(np.arange(size), size, key=10))


def test_epoch_permutation_needs_no_table():
    """A position of a dataset of 10^12 examples maps in O(1): distinct images, inside the range."""
    size, positions = 10 ** 12, np.arange(10 ** 12 - 50_000, 10 ** 12)
    image = permute(positions, size, key=123)
    assert len(np.unique(image)) == len(positions) and image.min() >= 0 and image.max() < size
    assert np.array_equal(permute(positions[-7:], size, key=123), image[-7:])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    examples = create_examples(synthetic_documents(30), 40, 0.1, 1, CLS, SEP, random.Random(3))
    for e in examples:
        e.tokens = [t % 590 + 5 if t not in (CLS, SEP) else t for t in e.tokens]
    parts = (examples[:50], [], examples[50:51], examples[51:])  # shards of several sizes, one empty
    entries = [write_shard(str(out), f"shard_{i:05d}", part, 600) for i, part in enumerate(parts)]
    write_index(str(out), {"max_seq_length": 40, "vocab_size": 600, "shards": entries,
                           "special_ids": {"pad": 0, "unk": 1, "cls": CLS, "sep": SEP, "mask": 4}})
    with open(out / "vocab.txt", "w") as f:
        f.writelines(t + "\n" for t in vocabulary())
    return ShardedDataset(str(out))


def test_read_examples_across_shards(dataset):
    indices = np.array([len(dataset) - 1, 0, 50, 49, 51, 7, 50])
    batch = ShardReader(dataset).read(indices, pad_id=0, pad_to_multiple_of=8)
    assert batch.tokens.shape[1] % 8 == 0 and batch.tokens.shape[1] - 8 < batch.lengths.max()
    for row, index in enumerate(indices):
        tokens, a_length, label = dataset[int(index)]
        assert batch.lengths[row] == len(tokens) and batch.a_lengths[row] == a_length
        assert batch.next_sentence_labels[row] == label
        assert batch.tokens[row, :len(tokens)].tolist() == tokens.tolist()
        assert not batch.tokens[row, len(tokens):].any()


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


def test_steps_built_together_equal_steps_built_alone(dataset):
    collator = MaskingCollator(dataset.vocabulary(), whole_word=True)
    together = PretrainingLoader(dataset, collator, 8, 2, seed=3)  # 32 steps per build
    alone = PretrainingLoader(dataset, collator, 8, 2, seed=3, rows_per_build=1)
    start = len(dataset) - 20  # across an epoch's end
    stream = together.steps(start)
    for k in range(6):
        built, single = next(stream), alone.step(start + 8 * k)
        assert len(built) == len(single) == 4
        for a, b in zip(built, single):  # the same tensors, each micro-batch padded to its own longest
            assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
            assert a["input_ids"].is_contiguous() and a["input_ids"].shape[1] - 8 < int(a["attention_mask"].sum(1).max())


def test_epochs_cover_the_dataset_and_reshuffle(dataset):
    loader = PretrainingLoader(dataset, MaskingCollator(dataset.vocabulary()), 4, 4, seed=1)
    n = len(dataset)
    indices, keys = loader.examples(np.arange(2 * n))
    assert sorted(indices[:n].tolist()) == list(range(n)) and sorted(indices[n:].tolist()) == list(range(n))
    assert not np.array_equal(indices[:n], indices[n:])
    assert np.array_equal(keys, hash_keys(1, 0, [0] * n + [1] * n, indices))  # seed, phase, epoch, example
    some = np.array([2 * n - 1, 3, n + 5, n - 1])
    assert all(np.array_equal(a, b[some]) for a, b in zip(loader.examples(some), (indices, keys)))
    stream = prefetch(loader.steps(0), depth=2)
    first = [next(stream) for _ in range(3)]
    resumed = next(prefetch(loader.steps(8), depth=2))  # a stream restarted at position 8 is step 3's
    assert all(torch.equal(resumed[0][k], first[2][0][k]) for k in resumed[0])
    stream.close()


def test_prefetch_runs_torch_at_the_given_thread_count():
    def thread_counts():
        while True:
            yield torch.get_num_threads()

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the loader's 1 differs from the caller's on any machine
    try:
        stream = prefetch(thread_counts(), threads=1)
        assert next(stream) == 1
        stream.close()
        assert torch.get_num_threads() == 2  # the setting stays in the loader's thread
    finally:
        torch.set_num_threads(before)


def test_prepare_data_perf_section_projects_from_the_measured_rate():
    from fastbert.bench.prepare_report import prepare_data_section

    common = {"suite": "prepare-data", "date": "2026-01-01T00:00:00+00:00", "chunk_bytes": 32 << 20,
              "documents": 100, "peak_rss_worker_bytes": 200 << 20, "peak_rss_parent_bytes": 100 << 20,
              "peak_rss_tree_bytes": 500 << 20, "load_average_1min": 1.0}
    rows = [{**common, "op": "vocab-training", "corpus": "a", "corpus_bytes": 100 << 20, "sample_bytes": 100 << 20,
             "workers": 1, "wall_s": 50.0, "cpu_s": 50.0, "mib_per_cpu_s": 2.0},
            {**common, "op": "sharding", "corpus": "a", "corpus_bytes": 100 << 20, "workers": 1, "wall_s": 100.0,
             "cpu_s": 100.0, "mib_per_cpu_s": 1.0},
            {**common, "op": "sharding", "corpus": "a", "corpus_bytes": 100 << 20, "workers": 2, "wall_s": 50.0,
             "cpu_s": 100.0, "mib_per_cpu_s": 1.0}]
    text = "\n".join(prepare_data_section(rows, lambda run: "provenance"))
    assert "**1.00 MiB of text per CPU-second**" in text
    assert "2 worker(s) 1.00 CPU-s per MiB, wall time 2.00x as fast as 1" in text
    assert "- 16 cores: sharding about 17 min" in text and "- 64 cores: sharding about 4 min" in text  # 16384 s / n
    assert "0.50 CPU-s per MiB of sample" in text and "about 9 min of CPU time" in text  # 0.5 * 1024 s
    assert "Not yet measured" in "\n".join(prepare_data_section([], lambda run: ""))
