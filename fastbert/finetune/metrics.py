"""Evaluation metrics of the BERT paper's tasks, in plain Python / numpy (no scikit-learn, seqeval or scipy).

- accuracy; F1 (binary on the positive class, or macro over classes); Matthews correlation in its
  multi-class form (Gorodkin 2004, as scikit-learn), for CoLA;
- Pearson and Spearman correlation (Pearson of average ranks, ties sharing their mean rank), for STS-B;
- SQuAD exact match and F1 over the normalised answer text, the best over the gold answers, as the
  official evaluate-v2.0.py (a question without an answer has the single gold answer "");
- entity-level precision, recall and F1 for tagging, with conlleval's chunk rules (BIO, IOB1, BIOES
  and IO tags all read correctly).
"""
from __future__ import annotations

import collections
import re
import string

import numpy as np


def accuracy(predictions, labels) -> float:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    return float((predictions == labels).mean())


def _confusion(predictions, labels, num_classes: int) -> np.ndarray:
    """[true class, predicted class] counts."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (np.asarray(labels), np.asarray(predictions)), 1)
    return matrix


def _f1(tp: float, fp: float, fn: float) -> float:
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def f1(predictions, labels, num_classes: int, positive: int = 1) -> float:
    """Binary F1 of class `positive` when num_classes == 2 (GLUE's MRPC and QQP), macro F1 otherwise."""
    matrix = _confusion(predictions, labels, num_classes)
    tp = np.diag(matrix)
    fp, fn = matrix.sum(0) - tp, matrix.sum(1) - tp
    if num_classes == 2:
        return _f1(tp[positive], fp[positive], fn[positive])
    return float(np.mean([_f1(*counts) for counts in zip(tp, fp, fn)]))


def matthews_corrcoef(predictions, labels, num_classes: int) -> float:
    """(c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2)(s^2 - sum_k t_k^2)); 0 when undefined."""
    matrix = _confusion(predictions, labels, num_classes).astype(np.float64)
    t, p = matrix.sum(1), matrix.sum(0)
    c, s = np.trace(matrix), matrix.sum()
    denominator = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return 0.0 if denominator == 0 else float((c * s - p @ t) / denominator)


def pearson(x, y) -> float:
    """Pearson correlation; 0 when either side is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return 0.0 if denominator == 0 else float((x @ y) / denominator)


def _average_ranks(values) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):  # tied values share the mean of their ranks
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x, y) -> float:
    return pearson(_average_ranks(x), _average_ranks(y))


# SQuAD ------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and the articles a / an / the removed, white space collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:  # a no-answer side scores 1 only against another no-answer
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], golds: list[list[str]]) -> dict[str, float]:
    """exact_match and f1 in percent, each question scored against its best gold answer ([""] = none). As the
    official evaluate-v2.0.py: a gold answer that normalises to nothing (an article, punctuation) is dropped, and a
    question left with none is scored against no answer."""
    golds = [[g for g in gold if normalize_answer(g)] or [""] for gold in golds]
    exact = [max(squad_exact(p, g) for g in gold) for p, gold in zip(predictions, golds)]
    overlap = [max(squad_f1(p, g) for g in gold) for p, gold in zip(predictions, golds)]
    return {"exact_match": 100.0 * float(np.mean(exact)), "f1": 100.0 * float(np.mean(overlap))}


# entity-level F1 --------------------------------------------------------------------------------

def _split_tag(tag: str) -> tuple[str, str]:
    """(prefix, type): "B-PER" -> ("B", "PER"); "O" -> ("O", ""); a bare "PER" is inside a PER chunk."""
    if tag == "O":
        return "O", ""
    prefix, sep, kind = tag.partition("-")
    if sep and prefix in ("B", "I", "E", "S"):
        return prefix, kind
    return "I", tag


def entities(tags: list[str]) -> set[tuple[int, int, str]]:
    """(first word, last word, type) of every chunk, by conlleval's start-of-chunk / end-of-chunk rules."""
    chunks, start = set(), None
    prev_prefix, prev_kind = "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, kind = _split_tag(tag)
        ends = (prev_prefix in ("E", "S")
                or (prev_prefix in ("B", "I") and prefix in ("B", "S", "O"))
                or (prev_prefix != "O" and prev_kind != kind))
        if start is not None and ends:
            chunks.add((start, i - 1, prev_kind))
            start = None
        begins = (prefix in ("B", "S")
                  or (prev_prefix in ("E", "S", "O") and prefix in ("I", "E"))
                  or (prefix != "O" and prev_kind != kind))
        if begins:
            start = i
        prev_prefix, prev_kind = prefix, kind
    return chunks


def entity_scores(predicted: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """Entity precision, recall and F1 (percent) over sentences, an entity counting only when its span
    and type both match; plus word-level accuracy."""
    found = correct = expected = 0
    words = right = 0
    for pred_tags, gold_tags in zip(predicted, gold):
        pred_chunks, gold_chunks = entities(pred_tags), entities(gold_tags)
        found += len(pred_chunks)
        expected += len(gold_chunks)
        correct += len(pred_chunks & gold_chunks)
        words += len(gold_tags)
        right += sum(p == g for p, g in zip(pred_tags, gold_tags))
    precision = correct / found if found else 0.0
    recall = correct / expected if expected else 0.0
    score = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": 100.0 * precision, "recall": 100.0 * recall, "f1": 100.0 * score,
            "accuracy": 100.0 * right / max(words, 1)}
