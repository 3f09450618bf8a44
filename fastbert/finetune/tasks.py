"""Task families: how each reads its files, turns examples into model inputs, and scores predictions.

A task turns examples into features (model inputs, one or more per example) and metadata (what it
needs to map a feature's logits back to its example), and turns logits into one prediction per
example. Families (the paper's section 4):
    classification          GLUE-style single sentences or pairs -> the first token ([CLS], <s>) -> label
    regression              the same with a real-valued label (STS-B), num_labels = 1
    token-classification    CoNLL tagging, labels on the first piece of each word
    multiple-choice         SWAG: the pair (context, prefix + ending) per ending, softmax over endings
    question-answering      SQuAD v1.1 / v2.0 (fastbert.finetune.squad)
Pairs are laid out by the tokenizer's own template (fastbert.finetune.encoding.Packer). Each task names
its head ("ForSequenceClassification", ...); the model is built by fastbert.finetune.loading.load_task_model.
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
from fastbert.finetune.readers import DataError, read_conll, read_table
from fastbert.validation import IGNORE_INDEX


@dataclass
class Columns:
    """Column names of table files (CSV / TSV / JSONL), from the command's flags."""
    text: str
    text_pair: str | None
    label: str
    choices: tuple[str, ...] = ()
    format: str | None = None  # csv | tsv | jsonl; None = from the file's extension


@dataclass
class TableExample:
    path: str
    line: int
    text: str
    text_pair: str | None
    label: str
    choices: tuple[str, ...] = ()


def _label_order(labels) -> list[str]:
    """Labels sorted numerically when they are all numbers ("0" < "1" < "10"), as text otherwise."""
    labels = set(labels)
    try:
        return sorted(labels, key=float)
    except ValueError:
        return sorted(labels)


class Task:
    """The interface the training loop uses; subclasses fill it in per family."""
    name: str
    head: str  # the model head, as transformers names it after the architecture: "ForSequenceClassification"
    main_metric: str  # picks the best epoch unless --metric names another
    metric_names: tuple[str, ...]  # what score() returns
    per_token = False  # logits are per position: the loop trims them to each feature's length

    def __init__(self, packer: Packer):
        self.packer = packer

    def read(self, path: str) -> list:
        raise NotImplementedError

    def fit(self, train_examples: list) -> None:
        """Learn what the training set fixes (the label set); default: nothing."""

    def model_overrides(self) -> dict:
        return {}

    def tokenizer_settings(self) -> dict:
        """tokenizer_config.json entries the output needs for transformers' tokenizer to split as features() does."""
        return {}

    def features(self, examples: list) -> tuple[list[dict], list]:
        """(model inputs, metadata) per feature; metadata is what predict() needs besides logits."""
        raise NotImplementedError

    def logits(self, output) -> torch.Tensor:
        return output.logits

    def predict(self, examples: list, meta: list, logits: list[np.ndarray]) -> list:
        raise NotImplementedError

    def score(self, examples: list, predictions: list) -> dict[str, float]:
        raise NotImplementedError

    def record(self, example, prediction) -> dict:
        """One line of predictions.jsonl."""
        return {"line": example.line, "prediction": prediction}

    def write_predictions(self, out: str, examples: list, predictions: list) -> None:
        with open(os.path.join(out, "predictions.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(self.record(e, p)) + "\n" for e, p in zip(examples, predictions))


class SequenceTask(Task):
    """classification (labels from the training file) and regression (one real-valued output)."""

    head = "ForSequenceClassification"

    def __init__(self, packer: Packer, columns: Columns, regression: bool):
        super().__init__(packer)
        self.columns, self.regression = columns, regression
        self.name = "regression" if regression else "classification"
        self.main_metric = "pearson" if regression else "accuracy"
        self.metric_names = ("pearson", "spearman", "mse") if regression else ("accuracy", "f1", "matthews")
        self.labels: list[str] = []
        self.label_ids: dict[str, int] = {}

    def read(self, path: str) -> list[TableExample]:
        c = self.columns
        names = [c.text] + ([c.text_pair] if c.text_pair else []) + [c.label]
        examples = [TableExample(path, line, v[c.text], v.get(c.text_pair), v[c.label].strip())
                    for line, v in read_table(path, names, c.format)]
        for e in examples:
            try:
                value = float(e.label)
            except ValueError:
                value = None
            if self.regression and (value is None or not math.isfinite(value)):
                raise DataError(path, e.line, f"label {e.label!r} in column {c.label!r} is not a finite number; "
                                              "regression needs real-valued labels")
            if value is not None and math.isnan(value):  # pandas, and so datasets' CSV reader, read it as missing
                raise DataError(path, e.line, f"label {e.label!r} in column {c.label!r} is a missing value (NaN), "
                                              "not a class; give the example its label or leave the row out")
        return examples

    def fit(self, train_examples: list[TableExample]) -> None:
        if not self.regression:
            self.labels = _label_order(e.label for e in train_examples)
            self.label_ids = {label: i for i, label in enumerate(self.labels)}
            if len(self.labels) < 2:
                e = train_examples[0]
                raise DataError(e.path, None, f"every training example has the label {e.label!r}; "
                                              "classification needs at least two classes")

    def model_overrides(self) -> dict:
        if self.regression:
            return {"num_labels": 1, "problem_type": "regression"}
        return {"num_labels": len(self.labels), "problem_type": "single_label_classification",
                "id2label": dict(enumerate(self.labels)), "label2id": dict(self.label_ids)}

    def label_value(self, example: TableExample):
        if self.regression:
            return float(example.label)
        if example.label not in self.label_ids:
            raise DataError(example.path, example.line, f"label {example.label!r} was not seen in training "
                                                        f"(training labels: {', '.join(self.labels)})")
        return self.label_ids[example.label]

    def features(self, examples: list[TableExample]):
        pair = [e.text_pair for e in examples] if self.columns.text_pair else None
        inputs = self.packer.pack_texts([e.text for e in examples], pair)
        for feature, example in zip(inputs, examples):
            feature["labels"] = self.label_value(example)
        return inputs, list(range(len(examples)))

    def predict(self, examples, meta, logits):
        if self.regression:
            return [float(row[0]) for row in logits]
        return [self.labels[int(np.argmax(row))] for row in logits]

    def score(self, examples, predictions):
        if self.regression:
            gold = np.array([float(e.label) for e in examples])
            predicted = np.array(predictions)
            return {"pearson": metrics.pearson(predicted, gold), "spearman": metrics.spearman(predicted, gold),
                    "mse": float(((predicted - gold) ** 2).mean())}
        ids = self.label_ids
        gold = [self.label_value(e) for e in examples]
        predicted = [ids[p] for p in predictions]
        n = len(self.labels)
        return {"accuracy": metrics.accuracy(predicted, gold), "f1": metrics.f1(predicted, gold, n),
                "matthews": metrics.matthews_corrcoef(predicted, gold, n)}


class TokenTask(Task):
    """CoNLL tagging. The first piece of a word carries its tag; the other pieces are ignored (-100)
    in the loss and the word's predicted tag is read from its first piece. Words cut off by
    max_seq_length are predicted "O"."""

    name = "token-classification"
    head = "ForTokenClassification"
    main_metric = "f1"
    metric_names = ("precision", "recall", "f1", "accuracy")
    per_token = True

    def __init__(self, packer: Packer):
        super().__init__(packer)
        self.labels: list[str] = []
        self.label_ids: dict[str, int] = {}

    def read(self, path: str):
        return read_conll(path)

    def fit(self, train_examples) -> None:
        self.labels = sorted({tag for s in train_examples for tag in s.tags})
        self.label_ids = {label: i for i, label in enumerate(self.labels)}
        if len(self.labels) < 2:
            first = train_examples[0]
            raise DataError(first.path, None, f"every word is tagged {self.labels}; tagging needs at least two tags")

    def model_overrides(self) -> dict:
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)),
                "label2id": dict(self.label_ids)}

    def tokenizer_settings(self) -> dict:
        # transformers' RoBERTa-type tokenizer takes split words (a pipeline's, is_split_into_words) as these
        # features do only with add_prefix_space: without it a sentence's first word splits otherwise
        return {"add_prefix_space": True} if self._byte_level() else {}

    def _byte_level(self) -> bool:
        from tokenizers.pre_tokenizers import ByteLevel

        return isinstance(self.packer.tokenizer.pre_tokenizer, ByteLevel)

    def features(self, examples):
        ids = self.label_ids
        budget = self.packer.max_seq_length - self.packer.special_tokens(pair=False)
        first = self.packer.start(0)  # position of the first word piece, after [CLS] / <s>
        tokenizer = self.packer.tokenizer
        words = [s.words for s in examples]
        if self._byte_level():
            # byte-level BPE (RoBERTa) carries a word's leading space in its first piece ("Ġsaw"): words read
            # one by one get it as in running text (transformers' add_prefix_space=True for split words)
            words = [[" " + w for w in sentence] for sentence in words]
        encodings = tokenizer.encode_batch(words, is_pretokenized=True, add_special_tokens=False)
        inputs, meta = [], []
        for sentence, encoding in zip(examples, encodings):
            for word, tag in enumerate(sentence.tags):
                if tag not in ids:
                    raise DataError(sentence.path, sentence.line + word,
                                    f"tag {tag!r} was not seen in training (training tags: {', '.join(self.labels)})")
            pieces = encoding.ids[:budget]
            labels = [IGNORE_INDEX] * len(pieces)
            first_piece: dict[int, int] = {}
            for position, word in enumerate(encoding.word_ids[:budget]):
                if word is not None and word not in first_piece:
                    first_piece[word] = position + first
                    labels[position] = ids[sentence.tags[word]]
            feature = self.packer.pack(pieces)
            feature["labels"] = [IGNORE_INDEX] * first + labels
            feature["labels"] += [IGNORE_INDEX] * (len(feature["input_ids"]) - len(feature["labels"]))
            inputs.append(feature)
            meta.append(first_piece)
        return inputs, meta

    def predict(self, examples, meta, logits):
        predictions = []
        for sentence, first_piece, row in zip(examples, meta, logits):
            best = row.argmax(-1)
            predictions.append([self.labels[best[first_piece[w]]] if w in first_piece else "O"
                                for w in range(len(sentence.words))])
        return predictions

    def score(self, examples, predictions):
        return metrics.entity_scores(predictions, [s.tags for s in examples])


class ChoiceTask(Task):
    """SWAG-style multiple choice: each ending is scored from its first token ([CLS], <s>), softmax over
    endings."""

    name = "multiple-choice"
    head = "ForMultipleChoice"
    main_metric = "accuracy"
    metric_names = ("accuracy",)

    def __init__(self, packer: Packer, columns: Columns):
        super().__init__(packer)
        if len(columns.choices) < 2:
            raise ValueError(f"multiple choice needs at least two --choice-columns, got {list(columns.choices)}")
        self.columns = columns

    def read(self, path: str) -> list[TableExample]:
        c = self.columns
        names = [c.text] + ([c.text_pair] if c.text_pair else []) + list(c.choices) + [c.label]
        examples = []
        for line, v in read_table(path, names, c.format):
            label = v[c.label].strip()
            if label not in {str(i) for i in range(len(c.choices))}:
                raise DataError(path, line, f"label {label!r} in column {c.label!r} must be the index of the "
                                            f"right ending, 0 to {len(c.choices) - 1}")
            examples.append(TableExample(path, line, v[c.text], v.get(c.text_pair), label,
                                         tuple(v[name] for name in c.choices)))
        return examples

    def features(self, examples):
        contexts = self.packer.tokenize([e.text for e in examples])
        endings = self.packer.tokenize([f"{e.text_pair} {choice}" if e.text_pair else choice
                                        for e in examples for choice in e.choices])
        k = len(self.columns.choices)
        inputs = []
        for i, (example, context) in enumerate(zip(examples, contexts)):
            packed = [self.packer.pack(context, ending) for ending in endings[i * k:(i + 1) * k]]
            feature = {key: [p[key] for p in packed] for key in packed[0]}  # input_ids (token_type_ids)
            inputs.append({**feature, "labels": int(example.label)})
        return inputs, list(range(len(examples)))

    def predict(self, examples, meta, logits):
        return [int(np.argmax(row)) for row in logits]

    def score(self, examples, predictions):
        return {"accuracy": metrics.accuracy(predictions, [int(e.label) for e in examples])}
