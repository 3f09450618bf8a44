"""The fine-tuning loop: the paper's recipe (section 4 and appendix A.3) on one device.

Defaults: batch 32, 3 epochs, Adam with decoupled weight decay 0.01 (biases and LayerNorm exempt),
betas (0.9, 0.999), eps 1e-6, learning rate 2e-5 warmed up linearly over the first 10% of the steps
and decayed linearly to 0, gradients clipped to norm 1, dropout 0.1 everywhere. After each epoch the
model is evaluated on the eval file (when there is one) and saved to `out` in HF format when its
main metric is the best so far; without an eval file the last model is saved.

`--model` is a BERT checkpoint or one of the family (RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT,
MPNet) with the tokenizer it ships; BERT trains as fastbert's own classes, the family as transformers' head
classes accelerated by fastbert.apply (fastbert.finetune.loading.load_task_model).

`out` holds config.json + model.safetensors (with id2label for classification and tagging),
tokenizer.json (+ vocab.txt for BERT, + the source's tokenizer_config.json), finetune_config.json,
eval_results.json (every evaluation and the best) and the best model's predictions on the eval file.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from fastbert import ops
from fastbert.files import check_output_parent, output_lock, replaced_directory
from fastbert.finetune.encoding import Packer, collate, save_tokenizer_files, tokenizer_for
from fastbert.finetune.loading import checkpoint_directory, load_config, load_task_model, resolve_device
from fastbert.finetune.squad import QuestionAnsweringTask
from fastbert.finetune.tasks import ChoiceTask, Columns, SequenceTask, Task, TokenTask
from fastbert.train.optim import build_optimizer, linear_warmup_decay
from fastbert.train.pretrain import TrainingError
from fastbert.train.run import compute_dtype

TASKS = ("classification", "regression", "token-classification", "question-answering", "multiple-choice")
PAPER_LEARNING_RATES = (2e-5, 3e-5, 4e-5, 5e-5)  # the paper's fine-tuning grid (appendix A.3)
CONFIG_FILE = "finetune_config.json"  # marks a directory as a `fastbert finetune` output
LOWER_IS_BETTER = ("mse", "loss")
PRECISIONS = ("auto", "fp32", "bf16")
# training steps between the progress bar's loss readings (each one a host sync; the steps between wait for nothing)
LOSS_SHOWN_EVERY = 50
logger = logging.getLogger("fastbert.finetune")
# task -> (text column, text pair column) when the flags leave them unset: GLUE's and SWAG's names
DEFAULT_COLUMNS = {"classification": ("sentence", None), "regression": ("sentence", None),
                   "multiple-choice": ("sent1", "sent2")}


@dataclass
class FinetuneConfig:
    task: str  # one of TASKS
    model: str  # HF checkpoint directory of BERT or the family (transformers' or fastbert's pretraining output)
    train: str  # training file: CSV / TSV / JSONL table, CoNLL, or SQuAD JSON by task
    eval: str | None = None  # evaluation file in the same format; picks the best epoch
    out: str = "finetuned"  # output directory
    tokenizer: str | None = None  # tokenizer.json, vocab.txt (BERT) or a tokenizer directory; default: the model's
    lowercase: bool | None = None  # vocab.txt only; default: tokenizer_config.json's do_lower_case, else True
    # table columns (classification, regression, multiple choice)
    format: str | None = None  # csv | tsv | jsonl; default: from the file's extension
    text_column: str | None = None  # default: "sentence" (GLUE), "sent1" (SWAG)
    text_pair_column: str | None = None  # second segment; default none, "sent2" (SWAG); "" = none
    label_column: str = "label"
    choice_columns: tuple[str, ...] = ("ending0", "ending1", "ending2", "ending3")  # multiple choice endings
    # lengths (question answering's as in the paper's run_squad.py)
    max_seq_length: int | None = None  # default 128 (384 for question answering), at most the model's positions
    doc_stride: int = 128  # tokens between the starts of consecutive context windows
    max_query_length: int = 64  # questions are cut to this many tokens
    max_answer_length: int = 30  # longest predicted answer, in tokens
    n_best: int = 20  # start and end candidates per window
    null_score_diff_threshold: float = 0.0  # v2.0: predict "" when null score - best span score exceeds this
    version_2: bool | None = None  # allow null answers; default: iff the training file has unanswerable questions
    # the recipe
    batch_size: int = 32
    epochs: int = 3
    learning_rate: float = 2e-5
    warmup_proportion: float = 0.1  # fraction of the steps with a linearly rising learning rate
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    dropout: float = 0.1  # hidden and attention dropout (the classifier's follows the hidden one)
    seed: int = 42
    max_steps: int | None = None  # stop after this many optimizer steps (smoke runs)
    eval_batch_size: int = 64
    metric: str | None = None  # metric that picks the best epoch; default: the task's main metric
    device: str | None = None  # default: cuda when available, else cpu
    backend: str | None = None  # fastbert backend: auto | triton | torch; default: the checkpoint's
    precision: str = "auto"  # auto (bf16 autocast on a GPU that supports it, else fp32, as pretrain) | fp32 | bf16
    progress: bool = True  # tqdm progress bar

    def validate(self) -> None:
        """Each limit is named by the command's flag (--learning-rate), as the user typed it."""
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {TASKS}, got {self.task!r}")
        for name in ("batch_size", "epochs", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be a positive integer, got {self.max_steps}")
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"--learning-rate must be a positive number, got {self.learning_rate}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 < self.max_grad_norm < math.inf:  # no flag: the Python API's only
            raise ValueError(f"max_grad_norm must be a positive finite number, got {self.max_grad_norm}")
        if not 0 <= self.warmup_proportion < 1:
            raise ValueError(f"--warmup-proportion must be in [0, 1), got {self.warmup_proportion}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_seq_length is not None and self.max_seq_length < 4:
            raise ValueError(f"--max-seq-length must be at least 4, got {self.max_seq_length}")


def uses_bf16_autocast(precision: str, device: torch.device) -> bool:
    """Whether to train and evaluate under bf16 autocast: "bf16", or "auto" on a GPU that supports it
    (as pretrain decides). Raises ValueError for "bf16" off CUDA."""
    bf16 = compute_dtype(precision, device) == torch.bfloat16
    if bf16 and device.type != "cuda":
        raise ValueError(f"bf16 autocast needs a CUDA device, got {device}")
    return bf16


def build_task(cfg: FinetuneConfig, packer: Packer) -> Task:
    if cfg.task == "token-classification":
        return TokenTask(packer)
    if cfg.task == "question-answering":
        return QuestionAnsweringTask(packer, cfg.doc_stride, cfg.max_query_length, cfg.max_answer_length,
                                     cfg.n_best, cfg.null_score_diff_threshold, cfg.version_2)
    text, pair = DEFAULT_COLUMNS[cfg.task]
    columns = Columns(cfg.text_column or text, (pair if cfg.text_pair_column is None else cfg.text_pair_column) or None,
                      cfg.label_column, tuple(cfg.choice_columns), cfg.format)
    if cfg.task == "multiple-choice":
        return ChoiceTask(packer, columns)
    return SequenceTask(packer, columns, regression=cfg.task == "regression")


def check_output_directory(out: str, model: str) -> None:
    """--out is replaced as a whole when the run ends: refuse one that holds the model or other files, or that
    cannot be created (under a file)."""
    out_path, model_path = os.path.realpath(out), os.path.realpath(model)
    if os.path.commonpath([out_path, model_path]) == out_path:
        raise ValueError(f"--out {out} {'is' if out_path == model_path else 'contains'} the --model directory "
                         f"{model}: fine-tuning would replace the checkpoint it starts from; choose another --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; --out names the output directory")
    check_output_parent(out)
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, CONFIG_FILE)):
        raise ValueError(f"--out {out} holds files that `fastbert finetune` did not write (no {CONFIG_FILE}); "
                         "the output directory is replaced as a whole, so choose a new or empty one")


def batches(inputs: list[dict], batch_size: int, pad_id: int, order=None):
    order = list(range(len(inputs))) if order is None else order
    for i in range(0, len(order), batch_size):
        yield collate([inputs[j] for j in order[i:i + batch_size]], pad_id)


@torch.no_grad()
def evaluate(model, task: Task, examples: list, inputs: list[dict], meta: list, batch_size: int,
             device: torch.device, autocast: bool) -> tuple[dict[str, float], list]:
    """(scores, one prediction per example); scores include the mean eval loss."""
    model.eval()
    logits, losses = [], []
    for batch in batches(inputs, batch_size, task.packer.pad_id):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            output = model(**batch)
        losses.append(float(output.loss) * len(batch["input_ids"]))
        values = task.logits(output).float().cpu().numpy()
        lengths = batch["attention_mask"].sum(-1).cpu().tolist()
        logits += [row[:n] if task.per_token else row for row, n in zip(values, lengths)]
    model.train()
    predictions = task.predict(examples, meta, logits)
    scores = task.score(examples, predictions)
    scores["loss"] = sum(losses) / len(inputs)
    return scores, predictions


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune and save; returns {"out", "steps", "history": [eval scores per evaluation], "best"}.

    Raises ValueError (DataError for bad files, naming the file and line) before training starts.
    `out` is built aside and replaces the previous one only when the run completes, under a lock.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    uses_bf16_autocast(cfg.precision, device)  # raises now for "bf16" off CUDA
    model_dir = checkpoint_directory(cfg.model)  # a hub id becomes its directory in the HF cache
    check_output_directory(cfg.out, model_dir)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    config = load_config(model_dir)
    ops.check_backend(cfg.backend or config.backend, device)
    tokenizer = tokenizer_for(model_dir, cfg.tokenizer, cfg.lowercase, config.model_type)
    # its settings files (tokenizer_config.json, special_tokens_map.json) come with the output from where it was read
    tokenizer_dir = cfg.tokenizer if cfg.tokenizer and os.path.isdir(cfg.tokenizer) else model_dir
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                         f"vocab_size ({config.vocab_size}): they do not belong together")
    positions = config.max_sequence_length  # RoBERTa's 514 positions hold 512 tokens
    max_seq_length = cfg.max_seq_length or min(384 if cfg.task == "question-answering" else 128, positions)
    if max_seq_length > positions:
        raise ValueError(f"--max-seq-length {max_seq_length} is longer than the {positions} tokens the model's "
                         f"max_position_embeddings ({config.max_position_embeddings}) hold")
    packer = Packer(tokenizer, max_seq_length, token_types=config.type_vocab_size > 1)
    task = build_task(cfg, packer)
    metric = cfg.metric or task.main_metric
    if metric not in (*task.metric_names, "loss"):
        raise ValueError(f"--metric {metric!r} is not one of {task.name}'s: {', '.join(task.metric_names)}, loss")

    train_examples = task.read(cfg.train)
    task.fit(train_examples)
    train_inputs, _ = task.features(train_examples)
    evaluation = None
    if cfg.eval:
        eval_examples = task.read(cfg.eval)
        evaluation = (eval_examples, *task.features(eval_examples))
    logger.info(f"{task.name}: {len(train_examples)} training examples -> {len(train_inputs)} features"
                + (f"; {len(evaluation[0])} eval examples" if evaluation else ""))

    model = load_task_model(config, task.head, model_dir, cfg.dropout, cfg.backend, **task.model_overrides())
    model = model.to(device).train()

    def save(directory: str, predictions) -> None:
        model.save_pretrained(directory)
        save_tokenizer_files(tokenizer, tokenizer_dir, directory, config.model_type, task.tokenizer_settings())
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        if predictions is not None:
            task.write_predictions(directory, evaluation[0], predictions)

    with output_lock(cfg.out), replaced_directory(cfg.out) as staging:
        step, history, best = train_loop(cfg, model, task, train_inputs, evaluation, metric, device,
                                         lambda predictions: save(staging, predictions))
        if evaluation is None:
            save(staging, None)
        with open(os.path.join(staging, "eval_results.json"), "w", encoding="utf-8") as f:
            json.dump({"metric": metric, "best": best, "history": history}, f, indent=2)
    logger.info(f"saved to {cfg.out}")
    return {"out": cfg.out, "steps": step, "history": history, "best": best}


def train_loop(cfg: FinetuneConfig, model, task: Task, train_inputs: list[dict], evaluation, metric: str,
               device: torch.device, save_best) -> tuple[int, list[dict], dict | None]:
    """The paper's recipe over the training features; after each epoch, evaluation and save_best(predictions)
    when the metric improved. Returns (steps, evaluation history, best evaluation)."""
    steps_per_epoch = math.ceil(len(train_inputs) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    optimizer = build_optimizer(model, "adamw", cfg.learning_rate, (0.9, 0.999), 1e-6, cfg.weight_decay,
                                sharded=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_warmup_decay(int(cfg.warmup_proportion * total_steps), total_steps))
    history: list[dict] = []
    best: dict | None = None

    from tqdm import tqdm
    autocast = uses_bf16_autocast(cfg.precision, device)
    generator = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(total=total_steps, unit="step", desc=f"fine-tuning ({task.name})", dynamic_ncols=True,
               disable=not cfg.progress)
    step, seen, started = 0, 0, time.perf_counter()
    unshown, unshown_loss = 0, torch.zeros((), device=device)  # steps since the bar showed the loss, their sum
    trained_loss = torch.zeros((), device=device)  # every step's: read only before a save (a host sync)
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(train_inputs), generator=generator).tolist()
        for batch in batches(train_inputs, cfg.batch_size, task.packer.pad_id, order):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seen += len(batch["input_ids"])
            unshown, unshown_loss = unshown + 1, unshown_loss + loss.detach().float()
            trained_loss += loss.detach().float()
            # reading the loss is a host sync: only every LOSS_SHOWN_EVERY steps, and only when it is shown
            if not bar.disable and (unshown == LOSS_SHOWN_EVERY or step == total_steps):
                bar.set_postfix(loss=f"{unshown_loss.item() / unshown:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}",
                                examples_per_s=f"{seen / (time.perf_counter() - started):.1f}", refresh=False)
                unshown, unshown_loss = 0, torch.zeros((), device=device)
            bar.update()
            if step >= total_steps:
                break
        if evaluation is not None:
            scores, predictions = evaluate(model, task, *evaluation, cfg.eval_batch_size, device, autocast)
            scores = {"epoch": epoch + 1, "step": step, **scores}
            history.append(scores)
            logger.info(f"epoch {epoch + 1}, step {step}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in scores.items() if k not in ("epoch", "step")))
            # NaN weights still score (argmax picks class 0), maybe above the best: judged before the scores are
            diverged = divergence(trained_loss, scores)
            if diverged and best is None:
                raise diverged_error(cfg, diverged, step)
            if diverged:
                logger.warning(f"fine-tuning diverged by step {step} ({diverged}); the best epoch's model (epoch "
                               f"{best['epoch']}) is kept and training stops. Lower --learning-rate (it is "
                               f"{cfg.learning_rate:g})")
                break
            sign = -1 if metric in LOWER_IS_BETTER else 1
            if best is None or sign * scores[metric] > sign * best[metric]:
                best = scores
                save_best(predictions)
                logger.info(f"best {metric} so far (kept for {cfg.out})")
        if step >= total_steps:
            break
    bar.close()
    diverged = divergence(trained_loss, None) if evaluation is None else None  # the last weights are what is saved
    if diverged:
        raise diverged_error(cfg, diverged, step)
    return step, history, best


def divergence(trained_loss: torch.Tensor, scores: dict | None) -> str | None:
    """What is not finite (a training step's loss, or the evaluation loss in scores), or None. Reads the loss: a
    host sync, once an epoch."""
    if not math.isfinite(trained_loss.item()):
        return "a training step's loss is not finite"
    if scores is not None and not math.isfinite(scores.get("loss", 0.0)):
        return "the evaluation loss is not finite"
    return None


def diverged_error(cfg: FinetuneConfig, what: str, step: int) -> TrainingError:
    """The error of a run that diverged before any model was worth saving (nothing is saved)."""
    return TrainingError(f"fine-tuning diverged by step {step}: {what}, so the weights may be NaN; nothing was saved "
                         f"to {cfg.out}. Lower --learning-rate (it is {cfg.learning_rate:g}) or --weight-decay (it is "
                         f"{cfg.weight_decay:g}), or check the data")
