"""What makes a run the same run: a resume refuses a checkpoint whose run differs in what exact
resumption depends on, and honours (and logs) the options that may change.

A checkpoint's run.json records the run's fingerprint: the options, the model's architecture and one
digest per phase dataset (its index.json, which names each shard's sha256, and its vocabulary).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from fastbert.data.examples import MLM_NSP
from fastbert.data.shards import INDEX_FILE, VOCAB_FILE

logger = logging.getLogger("fastbert.train")

# a difference here means the resumed run is not the checkpoint's run continued exactly
EXACT_OPTIONS = ("objective", "optimizer", "beta1", "beta2", "eps", "weight_decay", "batch_size", "seed", "seq_lengths",
                 "mask_prob", "whole_word_masking", "precision")
# these may change on resume: the new value is used from the resume step on
CHANGEABLE_OPTIONS = ("steps", "lr", "warmup", "max_grad_norm", "phase_fractions", "micro_batch_size", "log_every",
                      "save_every", "keep_checkpoints", "max_bad_steps", "stop_at", "activation_checkpointing",
                      "distributed", "device", "prefetch", "threads", "progress", "peak_tflops")
# config fields that shape the weights: a checkpoint with others cannot be loaded at all (model_type: the
# architecture, whose weights have other names; tie_word_embeddings: a tied checkpoint has no decoder of its own)
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "tie_word_embeddings")
MODEL_FIELDS = SHAPE_FIELDS + ("num_attention_heads", "hidden_act", "hidden_dropout_prob",
                               "attention_probs_dropout_prob", "layer_norm_eps", "pad_token_id")
# what a checkpoint written before a field was recorded ran with
RECORDED_LATER = {"objective": MLM_NSP, "model_type": "bert", "tie_word_embeddings": True}


def dataset_digest(directory: str) -> str:
    """sha256 of a prepared dataset's index.json (which holds each shard's sha256 and the tokenizer's)
    and its vocabulary."""
    digest = hashlib.sha256()
    for name in (INDEX_FILE, VOCAB_FILE):
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def model_fields(config) -> tuple[str, ...]:
    """The config fields a resume compares: MODEL_FIELDS, then the architecture's own (its config class's
    defaults: ModernBERT's local_attention, layer_types, mlp_dropout, ...; DistilBERT's sinusoidal_pos_embds)."""
    return MODEL_FIELDS + tuple(name for name in type(config).defaults if name not in MODEL_FIELDS)


def fingerprint(cfg, config, phases, dtype) -> dict:
    """The run's fingerprint (JSON-able): cfg a PretrainConfig, config its BertConfig, phases run.Phase."""
    options = {name: getattr(cfg, name) for name in EXACT_OPTIONS + CHANGEABLE_OPTIONS}
    options.update(seq_lengths=[p.seq_length for p in phases], precision=str(dtype).removeprefix("torch."))
    # as run.json will read back (tuples as lists), so that an unchanged value compares equal
    model = json.loads(json.dumps({name: getattr(config, name) for name in model_fields(config)}))
    return {"options": options, "model": model,
            "data": {str(p.seq_length): dataset_digest(p.dataset.directory) for p in phases}}


def check_resume(saved: dict, current: dict, checkpoint: str, accept_changes: bool) -> None:
    """Compare a checkpoint's fingerprint with this run's. Raises ValueError naming each option with both
    values when exactness would be lost (unless accept_changes: then they are logged as warnings), and
    always when the weights' shapes differ; logs the options that changed and are honoured."""
    def flag(name):
        return f"--{name.replace('_', '-')}"

    shapes, exact = [], []
    for name, now in current["model"].items():
        # a field a checkpoint did not record (written before the architecture's own fields were): not compared
        was = saved["model"].get(name, RECORDED_LATER.get(name, now))
        if was != now:
            (shapes if name in SHAPE_FIELDS else exact).append(f"--model.{name}: checkpoint {was!r}, now {now!r}")
    for name in EXACT_OPTIONS:
        was, now = saved["options"].get(name, RECORDED_LATER.get(name)), current["options"][name]
        if was != now:
            exact.append(f"{flag(name)}: checkpoint {was!r}, now {now!r}")
    for length, digest in current["data"].items():
        if saved["data"].get(length) != digest:
            exact.append(f"--data: the length-{length} dataset is not the one the checkpoint's run read "
                         "(its index, vocabulary or shards differ)")
    if shapes:
        raise ValueError(f"cannot resume from {checkpoint}: the model differs in shape ({'; '.join(shapes)}); "
                         "start a new run with --resume never or another --out")
    if exact and not accept_changes:
        raise ValueError(f"resuming from {checkpoint} would not continue its run exactly: {'; '.join(exact)}. "
                         "Pass --accept-changes to resume anyway, or start a new run with --resume never or "
                         "another --out")
    for change in exact:
        logger.warning(f"resuming with a change (--accept-changes): {change}")
    for name in CHANGEABLE_OPTIONS:
        was, now = saved["options"].get(name), current["options"][name]
        if was != now:
            logger.info(f"resuming with {flag(name)} {now!r} (the checkpoint's run had {was!r})")
