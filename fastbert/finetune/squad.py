"""Extractive question answering on SQuAD v1.1 / v2.0, as the paper's section 4.2-4.3 and its run_squad.py.

Features: the question (cut to max_query_length tokens) and a window of the context,
    [CLS] question [SEP] context[start : start + length] [SEP]
(or the tokenizer's own pair template: <s> question </s></s> context </s> for RoBERTa); windows start
every doc_stride tokens until one reaches the end of the context, so a long context gives several
overlapping features. A training feature whose window does not hold the whole answer (or whose question
has none, v2.0) points both positions at the first token ([CLS], <s>), the null answer.

Prediction per question, over all its windows: the best span (start, end) by start_logit + end_logit
among the n_best highest starts and ends, with start <= end, end - start + 1 <= max_answer_length,
both inside the window's context, and start in the window where that token has the most context
around it (min(left, right) + 0.01 * window length, the earliest window on ties). For v2.0 the null
score is the smallest first-token start + end logit over the windows; the answer is "" when
null_score - best_span_score > null_score_diff_threshold.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from fastbert.finetune import metrics
from fastbert.finetune.encoding import Packer
from fastbert.finetune.readers import QAExample, read_squad
from fastbert.finetune.tasks import Task


def windows(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of each context window: every `stride` tokens until one reaches the end."""
    spans, start = [], 0
    while True:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, stride)


def max_context(spans: list[tuple[int, int]]) -> list[list[bool]]:
    """Per window, per token: is this the window where the token has the most context on both sides?"""
    best: dict[int, tuple[float, int]] = {}
    for index, (start, length) in enumerate(spans):
        for position in range(start, start + length):
            score = min(position - start, start + length - 1 - position) + 0.01 * length
            if position not in best or score > best[position][0]:
                best[position] = (score, index)
    return [[best[p][1] == index for p in range(start, start + length)]
            for index, (start, length) in enumerate(spans)]


def token_span(offsets: list[tuple[int, int]], start_char: int, end_char: int) -> tuple[int, int] | None:
    """First and last token overlapping the characters [start_char, end_char); None when none does."""
    covering = [i for i, (s, e) in enumerate(offsets) if s < end_char and e > start_char]
    return (covering[0], covering[-1]) if covering else None


@dataclass
class Window:
    example: int  # index of the question in the examples
    context_start: int  # position of the window's first context token in input_ids
    offsets: list[tuple[int, int]]  # character span in the context of each of the window's context tokens
    max_context: list[bool]  # per context token: this window gives it the most context


class QuestionAnsweringTask(Task):
    name = "question-answering"
    head = "ForQuestionAnswering"
    main_metric = "f1"
    metric_names = ("exact_match", "f1")
    per_token = True

    def __init__(self, packer: Packer, doc_stride: int = 128, max_query_length: int = 64,
                 max_answer_length: int = 30, n_best: int = 20, null_score_diff_threshold: float = 0.0,
                 version_2: bool | None = None):
        super().__init__(packer)
        # named by `fastbert finetune`'s flags, which set them
        for name, value in (("--doc-stride", doc_stride), ("--max-query-length", max_query_length),
                            ("--max-answer-length", max_answer_length), ("--n-best", n_best)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        # NaN never compares greater, so v2.0 would never answer "no answer"; inf means the same
        if not math.isfinite(null_score_diff_threshold):
            raise ValueError(f"--null-score-diff-threshold must be a finite number, got {null_score_diff_threshold}")
        specials = packer.special_tokens(pair=True)
        if packer.max_seq_length - max_query_length - specials < 1:
            raise ValueError(f"--max-seq-length ({packer.max_seq_length}) leaves no room for the context after "
                             f"a question of --max-query-length ({max_query_length}) tokens and {specials} special "
                             "tokens")
        if packer.pair[0][0] is None:
            raise ValueError("the tokenizer's pair template does not start with a special token ([CLS], <s>), "
                             "where question answering puts the null answer")
        self.doc_stride, self.max_query_length = doc_stride, max_query_length
        self.max_answer_length, self.n_best = max_answer_length, n_best
        self.null_score_diff_threshold = null_score_diff_threshold
        self.version_2 = version_2  # None: v2.0 (null answers allowed) iff the training set has any

    def read(self, path: str) -> list[QAExample]:
        return read_squad(path)

    def fit(self, train_examples: list[QAExample]) -> None:
        if self.version_2 is None:
            self.version_2 = any(e.is_impossible for e in train_examples)

    def model_overrides(self) -> dict:
        return {"num_labels": 2}

    def features(self, examples: list[QAExample]):
        packer = self.packer
        questions = packer.tokenize([e.question for e in examples])
        contexts = sorted({e.context for e in examples})
        encoded = dict(zip(contexts, packer.tokenizer.encode_batch(contexts, add_special_tokens=False)))
        inputs, meta = [], []
        for index, (example, question) in enumerate(zip(examples, questions)):
            question = question[:self.max_query_length]
            context = encoded[example.context]
            spans = windows(len(context.ids), packer.max_seq_length - len(question) - packer.special_tokens(pair=True),
                            self.doc_stride)
            context_start = packer.start(1, len(question), pair=True)
            answer = None
            if example.answers and not example.is_impossible:
                text, start_char = example.answers[0]
                answer = token_span(context.offsets, start_char, start_char + len(text))
            for (start, length), flags in zip(spans, max_context(spans)):
                feature = packer.pack(question, context.ids[start:start + length])
                start_position = end_position = 0  # [CLS] / <s>: the null answer
                if answer is not None and start <= answer[0] and answer[1] < start + length:
                    start_position = answer[0] - start + context_start
                    end_position = answer[1] - start + context_start
                feature["start_positions"], feature["end_positions"] = start_position, end_position
                inputs.append(feature)
                meta.append(Window(index, context_start, context.offsets[start:start + length], flags))
        return inputs, meta

    def logits(self, output) -> torch.Tensor:
        return torch.stack([output.start_logits, output.end_logits], dim=-1)  # [B, S, 2]

    def predict(self, examples: list[QAExample], meta: list[Window], logits: list[np.ndarray]) -> list[str]:
        best: list[tuple[float, int, int] | None] = [None] * len(examples)
        null = [np.inf] * len(examples)
        for window, row in zip(meta, logits):
            start_logits, end_logits = row[:, 0], row[:, 1]
            null[window.example] = min(null[window.example], float(start_logits[0] + end_logits[0]))
            candidate = self.best_span(window, start_logits, end_logits)
            if candidate is not None and (best[window.example] is None or candidate[0] > best[window.example][0]):
                best[window.example] = candidate
        answers = []
        for example, span, null_score in zip(examples, best, null):
            if span is None or (self.version_2 and null_score - span[0] > self.null_score_diff_threshold):
                answers.append("")
            else:
                # .strip(): a byte-level or SentencePiece piece's offsets include the space before its word
                answers.append(example.context[span[1]:span[2]].strip())
        return answers

    def best_span(self, window: Window, start_logits: np.ndarray, end_logits: np.ndarray):
        """(score, first character, end character) of the window's best valid span, or None."""
        n = len(window.offsets)
        ends = np.argsort(end_logits, kind="stable")[-self.n_best:]
        best = None
        for i in np.argsort(start_logits, kind="stable")[-self.n_best:]:
            first = int(i) - window.context_start
            if not 0 <= first < n or not window.max_context[first]:
                continue
            for j in ends:
                last = int(j) - window.context_start
                if not first <= last < n or last - first + 1 > self.max_answer_length:
                    continue
                score = float(start_logits[i] + end_logits[j])
                if best is None or score > best[0]:
                    best = (score, window.offsets[first][0], window.offsets[last][1])
        return best

    def score(self, examples: list[QAExample], predictions: list[str]) -> dict[str, float]:
        golds = [[text for text, _ in e.answers] if e.answers and not e.is_impossible else [""] for e in examples]
        return metrics.squad_scores(predictions, golds)

    def record(self, example: QAExample, prediction: str) -> dict:
        return {"id": example.id, "prediction": prediction}

    def write_predictions(self, out: str, examples: list[QAExample], predictions: list[str]) -> None:
        """predictions.jsonl, and predictions.json ({id: answer}) for SQuAD's official evaluate script."""
        super().write_predictions(out, examples, predictions)
        with open(os.path.join(out, "predictions.json"), "w", encoding="utf-8") as f:
            json.dump({e.id: p for e, p in zip(examples, predictions)}, f, indent=1)
