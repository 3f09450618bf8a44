"""Fine-tuning data readers: what they read, and errors that name the file and the line."""
import csv
import json

import numpy as np
import pytest

from fastbert.finetune.encoding import Packer, collate, tokenizer_for
from fastbert.finetune.readers import DataError, read_conll, read_squad, read_table
from fastbert.finetune.tasks import ChoiceTask, Columns, TokenTask

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "john", "lives", "in", "new", "##york", ".", "a", "b"]


@pytest.fixture(scope="module")
def packer(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab")
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return Packer(tokenizer_for(str(path)), max_seq_length=16)


def test_tables(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text('sentence,label\n"one, with a comma",1\n\n"two ""quoted""",0\n')
    assert read_table(str(csv), ["sentence", "label"]) == [(2, {"sentence": "one, with a comma", "label": "1"}),
                                                           (4, {"sentence": 'two "quoted"', "label": "0"})]
    tsv = tmp_path / "a.tsv"
    tsv.write_text('sentence\tlabel\nsaid "hi\t1\n')  # GLUE's TSVs: quotes are text
    assert read_table(str(tsv), ["sentence"]) == [(2, {"sentence": 'said "hi'})]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "x", "label": 2}\n\n{"text": "y", "label": 0}\n')
    assert read_table(str(jsonl), ["text", "label"]) == [(1, {"text": "x", "label": "2"}),
                                                         (3, {"text": "y", "label": "0"})]


@pytest.mark.parametrize("name, text, columns, message", [
    ("a.csv", "sentence,label\nx,1\ny\n", ["sentence", "label"], r":3: missing or empty value for column 'label'"),
    ("a.csv", "sentence,label\nx,1,2\n", ["sentence"], r":2: 3 fields, but the header on line 1 names 2"),
    ("a.tsv", "text\tlabel\nx\t1\n", ["sentence"], r":1: no column 'sentence' in the header"),
    ("a.jsonl", '{"sentence": "x"}\n{"sentence": \n', ["sentence"], r":2: not a JSON object"),
    ("a.jsonl", '{"sentence": "x"}\n[1, 2]\n', ["sentence"], r":2: expected a JSON object, got list"),
    ("a.jsonl", '{"sentence": ""}\n', ["sentence"], r":1: missing or empty value for column 'sentence'"),
    ("a.csv", "\n\n", ["sentence"], r"a.csv: no records \(the file is empty\)"),
    ("a.tsv", "\nsentence\tlabel\n\n", ["sentence"], r"a.tsv: no records: only the header, on line 2"),
    ("a.xml", "<a/>", ["sentence"], r"a.xml: cannot tell the table format"),
])
def test_table_errors(tmp_path, name, text, columns, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        read_table(str(path), columns)


@pytest.mark.parametrize("name", ["a.tsv", "a.csv", "a.jsonl"])
def test_a_field_longer_than_the_csv_modules_limit_is_read(tmp_path, name):
    """The csv module refuses fields over 128 KiB by default; a table's field has no limit, as a JSONL value."""
    text = "word " * 40_000  # 200 KB
    separator = {"a.tsv": "\t", "a.csv": ","}.get(name)
    rows = (f"sentence{separator}label\n{text}{separator}1\n" if separator else
            json.dumps({"sentence": text, "label": "1"}) + "\n")
    (tmp_path / name).write_text(rows)
    line = 2 if separator else 1
    assert read_table(str(tmp_path / name), ["sentence", "label"]) == [(line, {"sentence": text, "label": "1"})]
    assert csv.field_size_limit() == 131072  # the module's limit is restored for other readers


def test_a_record_spanning_lines_is_named_by_its_first(tmp_path):
    """A quoted field may hold newlines: its record was named by its last line, and so was every message about it."""
    path = tmp_path / "a.csv"
    path.write_text('sentence,label\n"one\ntwo\nthree",1\nfour,0\n"five\nsix",1,extra\n')
    with pytest.raises(DataError, match=r"a.csv:6: 3 fields, but the header on line 1 names 2"):
        read_table(str(path), ["sentence", "label"])
    path.write_text('sentence,label\n"one\ntwo\nthree",1\nfour,0\n')
    assert read_table(str(path), ["sentence", "label"]) == [(2, {"sentence": "one\ntwo\nthree", "label": "1"}),
                                                            (5, {"sentence": "four", "label": "0"})]


def test_byte_order_mark_and_bad_bytes(tmp_path):
    path = tmp_path / "mrpc.tsv"
    path.write_bytes("\ufeffQuality\t#1 String\n1\tA caf\u00e9\n".encode("utf-8"))
    assert read_table(str(path), ["Quality", "#1 String"]) == [(2, {"Quality": "1", "#1 String": "A caf\u00e9"})]
    path.write_bytes(b"sentence\tlabel\nok\t1\nbad \xff\t0\n")
    with pytest.raises(DataError, match=r"mrpc.tsv:3: bytes that are not UTF-8"):
        read_table(str(path), ["sentence"])


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope.tsv: no such file"):
        read_table(str(tmp_path / "nope.tsv"), ["sentence"])


def test_conll_first_wordpiece_labels(tmp_path, packer):
    path = tmp_path / "train.txt"
    path.write_text("-DOCSTART- -X- -X- O\n\njohn NNP B-NP B-PER\nlives VBZ B-VP O\nin IN B-PP O\n"
                    "newyork NNP B-NP B-LOC\n. . O O\n\na X O O\n")
    sentences = read_conll(str(path))
    assert [(s.line, s.words) for s in sentences] == [(3, ["john", "lives", "in", "newyork", "."]), (9, ["a"])]
    task = TokenTask(packer)
    task.fit(sentences)
    assert task.labels == ["B-LOC", "B-PER", "O"]
    inputs, meta = task.features(sentences[:1])
    ids = [packer.tokenizer.id_to_token(i) for i in inputs[0]["input_ids"]]
    assert ids == ["[CLS]", "john", "lives", "in", "new", "##york", ".", "[SEP]"]
    # labels on the first piece of each word; ##york, [CLS] and [SEP] are ignored
    assert inputs[0]["labels"] == [-100, 1, 2, 2, 0, -100, 2, -100]
    assert meta[0] == {0: 1, 1: 2, 2: 3, 3: 4, 4: 6}
    # predictions are read from the first pieces; a word cut off by max_seq_length is "O"
    logits = np.zeros((8, 3))
    logits[[1, 4], [1, 0]] = 1.0
    logits[[2, 3, 6], 2] = 1.0
    meta[0].pop(4)
    assert task.predict(sentences[:1], meta, [logits]) == [["B-PER", "O", "O", "B-LOC", "O"]]


def test_conll_errors(tmp_path, packer):
    path = tmp_path / "dev.txt"
    path.write_text("john B-PER\nlives\n")
    with pytest.raises(DataError, match=r"dev.txt:2: expected a word and its tag"):
        read_conll(str(path))
    path.write_text("\n-DOCSTART- O\n\n")
    with pytest.raises(DataError, match=r"dev.txt: no sentences"):
        read_conll(str(path))
    path.write_text("john O\nlives O\n")
    task = TokenTask(packer)
    with pytest.raises(DataError, match=r"dev.txt: every word is tagged \['O'\]; tagging needs at least two tags"):
        task.fit(read_conll(str(path)))
    path.write_text("john B-PER\nlives O\n")
    task.fit(read_conll(str(path)))
    path.write_text("john B-PER\n\nlives O\nin B-MISC\n")
    with pytest.raises(DataError, match=r"dev.txt:4: tag 'B-MISC' was not seen in training"):
        task.features(read_conll(str(path)))


def squad_json(qas, context="alpha beta"):
    return {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


def test_squad_reader(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(squad_json([
        {"id": "a1", "question": "q?", "answers": [{"text": "beta", "answer_start": 6}]},
        {"id": "a2", "question": "q?", "answers": [], "is_impossible": True}]), indent=1))
    first, second = read_squad(str(path))
    assert (first.answers, first.is_impossible, second.is_impossible) == ([("beta", 6)], False, True)
    assert first.line is not None and second.line > first.line


@pytest.mark.parametrize("content, message", [
    ('{"data": [\n{"paragraphs": [}\n', r"train.json:2: malformed JSON"),
    ("", r"train.json: the file is empty"),
    ('{"version": "1.1"}', r"train.json:1: expected SQuAD JSON"),
    (json.dumps(squad_json([{"id": "x1", "answers": []}]), indent=1), r"train.json:\d+: .*qas\[0\] \(id 'x1'\) "
                                                                      r"has no \"question\""),
    (json.dumps(squad_json([{"id": "x1", "question": "q", "answers": []}])), r"has no answers and is not marked"),
    (json.dumps(squad_json([{"id": "x1", "question": "q", "answers": [{"text": "beta", "answer_start": 9}]}])),
     r"answer_start 9 puts 'beta' outside the context"),
    (json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}), r"data\[0\].paragraphs\[0\] has no \"context\""),
    (json.dumps(squad_json([])), r"no questions"),
])
def test_squad_errors(tmp_path, content, message):
    path = tmp_path / "train.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_squad(str(path))


def test_squad_error_line_is_the_question_line(tmp_path):
    path = tmp_path / "train.json"
    text = json.dumps(squad_json([{"id": "ok", "question": "q", "answers": [], "is_impossible": True},
                                  {"id": "bad", "answers": []}]), indent=1)
    path.write_text(text)
    line = text.splitlines().index(next(s for s in text.splitlines() if '"bad"' in s)) + 1
    with pytest.raises(DataError, match=rf"train.json:{line}: "):
        read_squad(str(path))


def test_multiple_choice_reading_and_packing(tmp_path, packer):
    path = tmp_path / "swag.csv"
    path.write_text("sent1,sent2,ending0,ending1,label\njohn lives,in,a,b,1\njohn,in,a,b,2\n")
    task = ChoiceTask(packer, Columns("sent1", "sent2", "label", ("ending0", "ending1")))
    with pytest.raises(DataError, match=r"swag.csv:3: label '2' .* must be the index of the right ending, 0 to 1"):
        task.read(str(path))
    path.write_text("sent1,sent2,ending0,ending1,label\njohn lives,in,a,b .,1\n")
    inputs, _ = task.features(task.read(str(path)))
    tokens = [[packer.tokenizer.id_to_token(i) for i in ids] for ids in inputs[0]["input_ids"]]
    assert tokens == [["[CLS]", "john", "lives", "[SEP]", "in", "a", "[SEP]"],
                      ["[CLS]", "john", "lives", "[SEP]", "in", "b", ".", "[SEP]"]]
    batch = collate(inputs, packer.pad_id)
    assert batch["input_ids"].shape == (1, 2, 8) and batch["labels"].tolist() == [1]
    assert batch["attention_mask"][0].sum(-1).tolist() == [7, 8]
    assert batch["token_type_ids"][0, 1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_pair_truncation_longest_first(packer):
    short = Packer(packer.tokenizer, max_seq_length=8)
    packed = short.pack([1, 2, 3, 4, 5, 6], [7, 8])  # budget 5: the longer side loses tokens first
    cls, sep = VOCAB.index("[CLS]"), VOCAB.index("[SEP]")
    assert packed["input_ids"] == [cls, 1, 2, 3, sep, 7, 8, sep]
    assert packed["token_type_ids"] == [0, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("settings", [{"strip_accents": False}, {"tokenize_chinese_chars": False},
                                      {"do_lower_case": False}, {}], ids=["accents", "chinese", "cased", "added"])
def test_a_bert_vocab_with_transformers_settings_tokenizes_as_transformers(tmp_path, settings):
    """A checkpoint with vocab.txt (no tokenizer.json) and tokenizer_config.json's settings or added_tokens.json:
    fastbert read do_lower_case alone, so accents, CJK characters and an added token split otherwise than in
    transformers' AutoTokenizer (what embed and finetune feed the model); convert left added_tokens.json out."""
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "cafe", "café", "naive", "東", "##京", "京", "hello",
             "world", "[", "]", "new", "##w", "Hello"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", **settings}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"[NEW]": len(vocab)}))
    text = "Hello café naive 東京 [NEW] world"
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"]
    assert tokenizer_for(str(tmp_path)).encode(text).ids == expected
    assert len(vocab) in expected  # the added token is one id in both


def test_conll_columns_are_split_at_spaces_and_tabs_only(tmp_path):
    """A word holding a non-breaking or other Unicode space (str.split() splits there) is one word: its first part
    was read as the word and the rest dropped without a message."""
    path = tmp_path / "ner.txt"
    path.write_text("New\u00a0York B-LOC\nis\tO\n10\u202f000 O\n\n", encoding="utf-8")
    (sentence,) = read_conll(str(path))
    assert sentence.words == ["New\u00a0York", "is", "10\u202f000"] and sentence.tags == ["B-LOC", "O", "O"]
