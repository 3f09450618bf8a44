"""Reading pretraining corpora into documents, each a list of sentences, in byte-bounded chunks.

Formats (chosen by file name):
- plain text (any name not ending in .jsonl): BERT's convention, one sentence per line and a blank
  line between documents;
- .jsonl: one JSON object per line, one document each, its text under "text"; the text is split into
  sentences at line breaks and after '.', '!' or '?' followed by white space.
- the name "stdlib": the docstrings of Python's standard library, one module per document, read
  from the source files with `ast` (nothing is imported), so every machine with Python has it.

`plan_chunks` cuts the corpus (its files one after another) into chunks of about `chunk_bytes`,
each a list of Segments (byte ranges of files), at document boundaries: after a blank line in a text
file, at a line end in a .jsonl file, between files of the standard library. A text document longer
than a quarter of a chunk may be cut at a line instead, its two parts read as two documents. So the
memory that reading a chunk needs is bounded by the chunk size, whatever the sizes of the corpus and
of its documents (one .jsonl line, one document, is read whole). The plan depends on the files'
bytes and chunk_bytes only.

A bad corpus raises CorpusError (a ValueError) naming the file and, where it applies, the line:
a missing file, a file with no text, bytes that do not decode (unless encoding_errors is "replace"
or "ignore"), a .jsonl line that is not an object with a string "text".
"""
from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

STDLIB = "stdlib"
ENCODING_ERRORS = ("strict", "replace", "ignore")
# a sentence ends at . ! or ? followed by white space
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# standard-library folders that are tests, tools or vendored code rather than documented modules
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
                "turtledemo", "idlelib", "tkinter", "ensurepip"}
_READ_BLOCK = 1 << 20


class CorpusError(ValueError):
    """A corpus that cannot be used, with the file (and line) at fault."""


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one file; `kind` says how to read them: "text", "jsonl" or "python"."""
    path: str
    start: int
    end: int
    kind: str


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


def _has_text(path: str) -> bool:
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            if block.strip():
                return True
    return False


def corpus_files(paths: list[str]) -> list[Segment]:
    """Every file of the corpus as one whole-file Segment, in order (the standard library expanded)."""
    check_paths(paths)
    files = []
    for path in paths:
        if path == STDLIB:
            files += [Segment(f, 0, os.path.getsize(f), "python") for f in stdlib_files()]
            continue
        if not _has_text(path):
            raise CorpusError(f"corpus file {path!r} contains no text")
        files.append(Segment(path, 0, os.path.getsize(path), "jsonl" if path.endswith(".jsonl") else "text"))
    return files


def _boundary(file: Segment, at: int, slack: int) -> int:
    """The first document boundary of `file` at or after byte `at` (see the module docstring)."""
    if file.kind == "python" or at <= 0:
        return file.end if at > 0 else 0
    with open(file.path, "rb") as f:
        f.seek(at - 1)
        f.readline()  # to the start of the first line at or after `at`
        line_start = f.tell()
        if file.kind == "jsonl":
            return line_start
        while f.tell() < at + slack:
            line = f.readline()
            if not line or not line.strip():  # the end, or a blank line: a document starts after it
                return f.tell()
        return line_start


def plan_chunks(paths: list[str], chunk_bytes: int) -> list[list[Segment]]:
    """The corpus cut into chunks of at most about chunk_bytes, each a list of Segments (module docstring)."""
    files = corpus_files(paths)
    total = sum(f.end for f in files)
    count = max(1, -(-total // chunk_bytes))
    targets = iter([total * k // count for k in range(1, count)] + [total])
    target = next(targets)
    chunks: list[list[Segment]] = [[]]
    offset = 0  # bytes of the corpus before the current file
    for file in files:
        start = 0
        while target <= offset + file.end and start < file.end:
            cut = min(max(_boundary(file, target - offset, chunk_bytes // 4), start), file.end)
            if cut > start:
                chunks[-1].append(Segment(file.path, start, cut, file.kind))
            if chunks[-1]:
                chunks.append([])
            start = cut
            target = next(targets, total + 1)
        if start < file.end:
            chunks[-1].append(Segment(file.path, start, file.end, file.kind))
        offset += file.end
    return [chunk for chunk in chunks if chunk]


def _line_number(path: str, offset: int, relative: int) -> int:
    """The file's line number of the `relative`-th line (1-based) after byte `offset`."""
    newlines = 0
    with open(path, "rb") as f:
        while offset > 0 and (block := f.read(min(_READ_BLOCK, offset))):
            newlines += block.count(b"\n")
            offset -= len(block)
    return newlines + relative


def _lines(segment: Segment, encoding_errors: str) -> Iterator[tuple[int, str]]:
    """(line number within the segment, line) of a UTF-8 segment; bad bytes raise CorpusError under "strict"."""
    with open(segment.path, "rb") as f:
        f.seek(segment.start)
        position, number = segment.start, 0
        while position < segment.end:
            raw = f.readline()
            if not raw:
                break
            position += len(raw)
            number += 1
            try:
                yield number, raw.decode("utf-8", errors=encoding_errors)
            except UnicodeDecodeError as exc:
                line = _line_number(segment.path, segment.start, number)
                raise CorpusError(
                    f"{segment.path}:{line}: byte {exc.start} of the line is not valid UTF-8 ({exc.reason}); "
                    "fix the file or pass --encoding-errors replace (or ignore)") from None


def _text_documents(segment: Segment, encoding_errors: str) -> Iterator[list[str]]:
    sentences: list[str] = []
    for _, line in _lines(segment, encoding_errors):
        line = line.strip()
        if line:
            sentences.append(line)
        elif sentences:
            yield sentences
            sentences = []
    if sentences:
        yield sentences


def _jsonl_documents(segment: Segment, encoding_errors: str) -> Iterator[list[str]]:
    for number, line in _lines(segment, encoding_errors):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            line_number = _line_number(segment.path, segment.start, number)
            raise CorpusError(f"{segment.path}:{line_number}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            line_number = _line_number(segment.path, segment.start, number)
            raise CorpusError(f'{segment.path}:{line_number}: expected an object with a string "text" field')
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


def _python_documents(segment: Segment) -> Iterator[list[str]]:
    """The docstrings of one standard-library module as one document."""
    try:
        with open(segment.path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a few files are templates or use another encoding: they are simply not part of it
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


def segment_documents(segment: Segment, encoding_errors: str = "strict") -> Iterator[list[str]]:
    """The documents of one segment, each a non-empty list of sentences."""
    if segment.kind == "python":
        return _python_documents(segment)
    if segment.kind == "jsonl":
        return _jsonl_documents(segment, encoding_errors)
    return _text_documents(segment, encoding_errors)


def read_documents(paths: list[str], encoding_errors: str = "strict") -> Iterator[list[str]]:
    """Every document of the corpus files in order, each a non-empty list of sentences.

    Raises CorpusError (see the module docstring); a file that yields no document is an error.
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {encoding_errors!r}")
    for file in corpus_files(paths):
        yield from segment_documents(file, encoding_errors)
