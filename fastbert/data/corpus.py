"""Reading pretraining corpora into documents, each a list of sentences.

Formats (chosen by file name):
- plain text (any name not ending in .jsonl): BERT's convention, one sentence per line and a blank
  line between documents;
- .jsonl: one JSON object per line, one document each, its text under "text"; the text is split into
  sentences at line breaks and after '.', '!' or '?' followed by white space.
- the name "stdlib": the docstrings of Python's standard library, one module per document, read
  from the source files with `ast` (nothing is imported), so every machine with Python has it.

A bad corpus raises CorpusError (a ValueError) naming the file and, where it applies, the line:
a missing file, a file with no text, bytes that do not decode (unless encoding_errors is "replace"
or "ignore"), a .jsonl line that is not an object with a string "text", fewer than 2 documents in
all (next sentence prediction draws its random segment from another document).
"""
from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
from collections.abc import Iterator

STDLIB = "stdlib"
ENCODING_ERRORS = ("strict", "replace", "ignore")
# a sentence ends at . ! or ? followed by white space
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# standard-library folders that are tests, tools or vendored code rather than documented modules
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
                "turtledemo", "idlelib", "tkinter", "ensurepip"}


class CorpusError(ValueError):
    """A corpus that cannot be used, with the file (and line) at fault."""


def split_sentences(text: str) -> list[str]:
    """Sentences of a free text: split at line breaks, then after sentence-final punctuation."""
    return [s for line in text.splitlines() for s in _SENTENCE_END.split(line.strip()) if s]


def check_paths(paths: list[str]) -> None:
    """Raise CorpusError for an empty list or a path that is not a readable file."""
    if not paths:
        raise CorpusError("no corpus files given")
    for path in paths:
        if path == STDLIB:
            continue
        if not os.path.exists(path):
            raise CorpusError(f"corpus file {path!r} does not exist")
        if not os.path.isfile(path):
            raise CorpusError(f"corpus path {path!r} is not a file")


def _lines(path: str, encoding_errors: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file; undecodable bytes raise CorpusError under "strict"."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8", errors=encoding_errors)
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{path}:{number}: byte {exc.start} of the line is not valid UTF-8 ({exc.reason}); "
                    "fix the file or pass --encoding-errors replace (or ignore)") from None


def _text_documents(path: str, encoding_errors: str) -> Iterator[list[str]]:
    sentences: list[str] = []
    for _, line in _lines(path, encoding_errors):
        line = line.strip()
        if line:
            sentences.append(line)
        elif sentences:
            yield sentences
            sentences = []
    if sentences:
        yield sentences


def _jsonl_documents(path: str, encoding_errors: str) -> Iterator[list[str]]:
    for number, line in _lines(path, encoding_errors):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusError(f'{path}:{number}: expected an object with a string "text" field')
        sentences = split_sentences(record["text"])
        if sentences:
            yield sentences


def stdlib_files() -> list[str]:
    """The .py files of this Python's standard library whose docstrings make the built-in corpus."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _STDLIB_SKIP and not d.startswith("config-"))
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def _stdlib_documents() -> Iterator[list[str]]:
    for path in stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are templates or use another encoding: they are simply not part of it
        sentences = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    # paragraphs are joined into running text; doctest lines are code, not prose
                    prose = [p for p in doc.split("\n\n") if not p.lstrip().startswith((">>>", "..."))]
                    sentences += split_sentences("\n".join(" ".join(p.split()) for p in prose))
        if sentences:
            yield sentences


def read_documents(paths: list[str], encoding_errors: str = "strict") -> Iterator[list[str]]:
    """Every document of the corpus files in order, each a non-empty list of sentences.

    Raises CorpusError (see the module docstring); a file that yields no document is an error.
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {encoding_errors!r}")
    check_paths(paths)
    for path in paths:
        if path == STDLIB:
            documents = _stdlib_documents()
        elif path.endswith(".jsonl"):
            documents = _jsonl_documents(path, encoding_errors)
        else:
            documents = _text_documents(path, encoding_errors)
        empty = True
        for document in documents:
            empty = False
            yield document
        if empty:
            raise CorpusError(f"corpus file {path!r} contains no text")
