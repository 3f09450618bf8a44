"""Readers for the data formats fine-tuning takes, each returning records that remember their source line.

- Tables: CSV (a header row, RFC 4180 quoting), TSV (a header row, no quoting, as GLUE's files) and
  JSONL (one object per line). Columns are named by the caller; a record is (line, {column: text}).
- CoNLL: one word per line, the word in the first column and its tag in the last (CoNLL-2003's
  four columns, or just two); blank lines end a sentence; -DOCSTART- lines are skipped.
- SQuAD v1.1 / v2.0 JSON: data[].paragraphs[].{context, qas[].{id, question, answers[], is_impossible}}.

Every problem raises DataError, a ValueError whose message starts with "FILE:LINE:" (or "FILE:" when
the problem is the file as a whole).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass, field

TABLE_FORMATS = ("csv", "tsv", "jsonl")
COLUMN_SEPARATOR = re.compile(r"[ \t]+")  # between CoNLL's columns


class DataError(ValueError):
    """Bad input data; the message names the file and, where there is one, the line."""

    def __init__(self, path: str, line: int | None, message: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
        self.path, self.line = path, line


def read_text(path: str) -> str:
    """The file's text: UTF-8, a byte-order mark (as in GLUE's MRPC files) dropped."""
    if os.path.isdir(path):
        raise DataError(path, None, "a directory, not a file")
    if not os.path.exists(path):  # not isfile(): a pipe or /dev/null is read like a file
        raise DataError(path, None, "no such file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(path, data.count(b"\n", 0, exc.start) + 1, f"bytes that are not UTF-8 ({exc.reason})") from None


def table_format(path: str, fmt: str | None = None) -> str:
    """The table format given, or the one the file's extension names (.csv, .tsv, .jsonl / .json)."""
    if fmt is None:
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        fmt = {"json": "jsonl", "txt": "tsv"}.get(ext, ext)
    if fmt not in TABLE_FORMATS:
        raise DataError(path, None, f"cannot tell the table format from the extension; pass --format "
                                    f"one of {TABLE_FORMATS}")
    return fmt


def read_table(path: str, columns: list[str], fmt: str | None = None) -> list[tuple[int, dict[str, str]]]:
    """(line, {column: value}) for each record, with every named column present and non-empty.

    Values are strings; JSONL values that are not (numbers, lists) become their JSON text. Raises
    DataError for a missing column or value, a malformed line, or a file without records.
    """
    fmt = table_format(path, fmt)
    records = []
    lines = io.StringIO(read_text(path), newline="")
    if fmt == "jsonl":
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(path, number, f"not a JSON object: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
            records.append((number, obj))
    else:
        quoting = csv.QUOTE_MINIMAL if fmt == "csv" else csv.QUOTE_NONE
        reader = csv.reader(lines, delimiter="," if fmt == "csv" else "\t", quoting=quoting)
        header = None
        # a field of any length, as a JSONL value (the csv module's default limit is 128 KiB)
        limit = csv.field_size_limit(2**31 - 1)
        end = 0  # the line the previous record ended on: a quoted field may span lines, so a record starts after it
        try:
            for row in reader:
                start, end = end + 1, reader.line_num
                if not any(cell.strip() for cell in row):
                    continue
                if header is None:
                    header = [cell.strip() for cell in row]
                    header_line = start
                    continue
                if len(row) > len(header):
                    raise DataError(path, start, f"{len(row)} fields, but the header on line "
                                                 f"{header_line} names {len(header)}")
                records.append((start, dict(zip(header, row))))
        except csv.Error as exc:
            raise DataError(path, reader.line_num, f"malformed {fmt.upper()}: {exc}") from None
        finally:
            csv.field_size_limit(limit)
        if header is not None:
            missing = [c for c in columns if c not in header]
            if missing:
                raise DataError(path, header_line, f"no column {missing[0]!r} in the header "
                                                   f"(columns: {', '.join(header)})")
            if not records:
                raise DataError(path, None, f"no records: only the header, on line {header_line}")
    if not records:
        raise DataError(path, None, "no records (the file is empty)")
    out = []
    for number, record in records:
        values = {}
        for column in columns:
            value = record.get(column)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DataError(path, number, f"missing or empty value for column {column!r} "
                                              f"(record has: {', '.join(map(str, record))})")
            values[column] = value if isinstance(value, str) else json.dumps(value)
        out.append((number, values))
    return out


@dataclass
class TaggedSentence:
    path: str
    line: int  # line of the sentence's first word
    words: list[str]
    tags: list[str]


def read_conll(path: str) -> list[TaggedSentence]:
    """Sentences of a CoNLL file: word in the first column, tag in the last, blank lines between sentences.
    A table (a .csv / .tsv / .jsonl name, or a tab-separated field holding spaces) is refused: its rows
    would be read as one word and a nonsense tag each."""
    if os.path.splitext(path)[1].lower() in (".csv", ".tsv", ".jsonl", ".json"):
        raise DataError(path, None, f"token classification reads CoNLL files (one word and its tag per line, a "
                                    f"blank line between sentences), not a {os.path.splitext(path)[1]} table; "
                                    "for one label per sentence use --task classification")
    sentences: list[TaggedSentence] = []
    current: TaggedSentence | None = None
    for number, text in enumerate(io.StringIO(read_text(path), newline=""), start=1):
        if "\t" in text and any(" " in field.strip() for field in text.split("\t")):
            raise DataError(path, number, f"a tab-separated field holds several words ({text.strip()[:60]!r}): "
                                          "this is a table, not CoNLL (one word and its tag per line); for one "
                                          "label per sentence use --task classification")
        # CoNLL's columns are split at spaces and tabs only: str.split() also splits a word at a non-breaking or
        # other Unicode space (New\u00a0York), whose first part was then the word and the rest dropped
        line = text.strip(" \t\r\n")
        fields = COLUMN_SEPARATOR.split(line) if line else []
        if not fields or fields[0] == "-DOCSTART-":
            if current is not None:
                sentences.append(current)
            current = None
            continue
        if len(fields) < 2:
            raise DataError(path, number, f"expected a word and its tag separated by white space, "
                                          f"got {text.strip()!r}")
        if current is None:
            current = TaggedSentence(path, number, [], [])
        current.words.append(fields[0])
        current.tags.append(fields[-1])
    if current is not None:
        sentences.append(current)
    if not sentences:
        raise DataError(path, None, "no sentences (the file is empty)")
    return sentences


@dataclass
class QAExample:
    id: str
    question: str
    context: str
    answers: list[tuple[str, int]] = field(default_factory=list)  # (text, character start in context)
    is_impossible: bool = False
    line: int | None = None  # line of the question's id in the JSON file, for error messages


def _line_of(raw: str, needle: str, start: int = 0) -> tuple[int | None, int]:
    """1-based line of `needle` in raw (searched from start) and the position after it."""
    at = raw.find(needle, start)
    if at < 0:
        return None, start
    return raw.count("\n", 0, at) + 1, at + len(needle)


def read_squad(path: str) -> list[QAExample]:
    """Questions of a SQuAD v1.1 or v2.0 file. Raises DataError naming the line (of the question's id
    where the JSON is well formed, so line numbers come from finding each id in the text) and the entry."""
    raw = read_text(path)
    if not raw.strip():
        raise DataError(path, None, "the file is empty")
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DataError(path, exc.lineno, f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise DataError(path, 1, "expected SQuAD JSON: an object with a \"data\" list")
    examples: list[QAExample] = []
    cursor = 0
    for a, article in enumerate(data):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise DataError(path, None, f"data[{a}] has no \"paragraphs\" list")
        for p, paragraph in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str):
                raise DataError(path, None, f"{where} has no \"context\" string")
            context = paragraph["context"]
            if not isinstance(paragraph.get("qas"), list):
                raise DataError(path, None, f"{where} has no \"qas\" list")
            for q, qa in enumerate(paragraph["qas"]):
                where_q = f"{where}.qas[{q}]"
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), (str, int)):
                    raise DataError(path, None, f"{where_q} has no \"id\"")
                line, cursor = _line_of(raw, json.dumps(str(qa["id"])), cursor)
                examples.append(_qa_example(path, line, where_q, qa, context))
    if not examples:
        raise DataError(path, None, "no questions in the file")
    return examples


def _qa_example(path: str, line: int | None, where: str, qa: dict, context: str) -> QAExample:
    question = qa.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(path, line, f"{where} (id {qa['id']!r}) has no \"question\" text")
    impossible = bool(qa.get("is_impossible", False))
    answers = []
    for i, answer in enumerate(qa.get("answers") or []):
        if not (isinstance(answer, dict) and isinstance(answer.get("text"), str)
                and isinstance(answer.get("answer_start"), int)):
            raise DataError(path, line, f"{where}.answers[{i}] (id {qa['id']!r}) needs \"text\" and an integer "
                                        f"\"answer_start\"")
        start, text = answer["answer_start"], answer["text"]
        if not 0 <= start <= len(context) - len(text):
            raise DataError(path, line, f"{where}.answers[{i}] (id {qa['id']!r}): answer_start {start} puts "
                                        f"{text!r} outside the context ({len(context)} characters)")
        if context[start:start + len(text)] != text:
            raise DataError(path, line, f"{where}.answers[{i}] (id {qa['id']!r}): the context at answer_start "
                                        f"{start} reads {context[start:start + len(text)]!r}, not the answer "
                                        f"text {text!r}")
        answers.append((text, start))
    if not answers and not impossible:
        raise DataError(path, line, f"{where} (id {qa['id']!r}) has no answers and is not marked is_impossible")
    return QAExample(str(qa["id"]), question, context, answers, impossible, line)
