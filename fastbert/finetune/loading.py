"""What `fastbert finetune`, `embed` and `convert` are pointed at: the checkpoint directory (or hub id), its
weights and the device, each checked so that a wrong one is a message naming the argument, never a traceback."""
from __future__ import annotations

import json
import os
import pickle

import torch

ACCEPTED = ("it takes a BERT checkpoint directory or one of the family's (RoBERTa, XLM-RoBERTa, CamemBERT, "
            "ELECTRA, DistilBERT, MPNet): config.json with model.safetensors or pytorch_model.bin, sharded or not, "
            "as transformers' save_pretrained, `fastbert finetune` and `fastbert pretrain` "
            "(runs/NAME/checkpoints/step_N/model) write it; or a hub id")


def weight_errors() -> tuple[type[Exception], ...]:
    """What reading damaged weights raises (a truncated or foreign safetensors file, a damaged .bin or index,
    shapes that disagree with config.json), in fastbert's loader and in transformers'."""
    from safetensors import SafetensorError

    return SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError, KeyError


def checkpoint_directory(path: str, flag: str = "--model") -> str:
    """The local checkpoint directory `path` names: `path` itself, or a hub id resolved through the HF cache
    (config, weights and tokenizer files). ValueError saying what is accepted when it is neither, or when
    the directory has no readable config.json."""
    from fastbert import hub

    if os.path.isfile(path):
        raise ValueError(f"{flag} {path} is a file; {ACCEPTED}")
    if not os.path.isdir(path):
        try:
            path = hub.resolve(path, tokenizer=True)
        except FileNotFoundError as exc:  # its message says what is accepted
            raise ValueError(f"{flag} {exc}") from None
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"{flag} {path} has no config.json; {ACCEPTED}")
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config}: not a JSON config ({exc}); the checkpoint is damaged") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config}: expected a JSON object, got {type(values).__name__}")
    if "model_type" not in values:  # a BERT config may lack it too, but not beside a run's checkpoints and metrics
        _refuse_run_directory(path, flag)
    return path


def _refuse_run_directory(path: str, flag: str) -> None:
    """ValueError naming the models inside `path` when it is a `fastbert pretrain` run directory (its config.json
    holds the run's options, not a model's): read as a checkpoint, it failed only after the data was tokenised."""
    from fastbert.train.checkpoint import CHECKPOINT_DIR, MODEL_DIR, latest_checkpoint
    from fastbert.train.run import METRICS_FILE

    checkpoints = os.path.join(path, CHECKPOINT_DIR)
    if not (os.path.isdir(checkpoints) or os.path.isfile(os.path.join(path, METRICS_FILE))):
        return
    newest = latest_checkpoint(checkpoints)
    models = os.path.join(checkpoints, "step_N", MODEL_DIR)
    raise ValueError(f"{flag} {path} is a `fastbert pretrain` run directory, not a model; its models are {models} "
                     + (f"(newest: {os.path.join(newest, MODEL_DIR)}), with the run's data's tokenizer.json as "
                        "--tokenizer" if newest else "and it has none yet"))


def load_checkpoint(cls, path: str, flag: str = "--model", **overrides):
    """(model, loading info) of `cls` from the checkpoint directory `path`. Unreadable weights (truncated
    or not safetensors, a damaged .bin or index, tensors whose shapes disagree with config.json) are a
    ValueError naming the directory; missing and unexpected keys are logged (fastbert.hf) and returned."""
    path = checkpoint_directory(path, flag)
    try:
        return cls.from_pretrained(path, output_loading_info=True, **overrides)
    except weight_errors() as exc:
        raise ValueError(f"{flag} {path}: the weights cannot be loaded ({type(exc).__name__}: "
                         f"{str(exc).strip()[:500]}); the files are damaged or do not match config.json") from None


def load_config(path: str, flag: str = "--model"):
    """The checkpoint's config, of the class its model_type names (BERT or one of the family); ValueError
    naming the file for a model_type fastbert does not build."""
    from fastbert import architectures

    config = os.path.join(checkpoint_directory(path, flag), "config.json")
    with open(config, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type", "bert")
    try:
        cls = architectures.config_class(model_type)
    except ValueError as exc:
        raise ValueError(f"{flag} {config}: {exc}") from None
    return cls.from_json(config)  # its errors name the file


def transformers_class(config, head: str) -> type:
    """transformers' class of `config`'s architecture with `head` (RobertaForSequenceClassification, ...)."""
    import transformers

    name = type(config).__name__.removesuffix("Config") + head
    if not hasattr(transformers, name):
        raise ValueError(f"transformers has no {name}: {config.architecture} has no {head.removeprefix('For')} head")
    return getattr(transformers, name)


# the dropouts in transformers' configs of the family, hidden, attention and the head's (a config has some of them)
DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob",  # BERT's names, which most keep
                  "summary_last_dropout",  # ELECTRA's multiple-choice head
                  "dropout", "attention_dropout", "seq_classif_dropout", "qa_dropout")  # DistilBERT's


def load_task_model(config, head: str, path: str, dropout: float, backend: str | None, **overrides):
    """The model fine-tuning trains: the checkpoint's encoder under a new `head` ("ForSequenceClassification",
    ...) with every dropout at `dropout` and overrides (num_labels, id2label, ...) set in its config.

    BERT: fastbert's own class. The family: transformers' class of the architecture and head (fastbert has
    native classes only for their base and masked-LM models), accelerated in place by fastbert.apply;
    it saves as transformers' checkpoint. ValueError naming the directory when the weights cannot be read."""
    from fastbert import architectures

    if config.model_type == "bert":
        overrides = dict(overrides, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                         classifier_dropout=None, **({"backend": backend} if backend else {}))
        # fp32, the dtype fine-tuning trains in, read from the weights as stored (dtype="auto" would round them to
        # config.json's dtype first)
        return load_checkpoint(architectures.model_class(config, head), path, dtype=torch.float32, **overrides)[0]
    from fastbert.in_place import apply

    cls = transformers_class(config, head)
    path = checkpoint_directory(path)
    hf_config = cls.config_class.from_pretrained(path)
    for name in DROPOUT_FIELDS:
        if hasattr(hf_config, name):
            setattr(hf_config, name, dropout)
    if hasattr(hf_config, "classifier_dropout"):
        hf_config.classifier_dropout = None  # the classifier's follows the hidden dropout
    for name, value in overrides.items():
        setattr(hf_config, name, value)
    try:
        model = cls.from_pretrained(path, config=hf_config, dtype=torch.float32)
    except weight_errors() as exc:
        raise ValueError(f"--model {path}: transformers cannot load the weights as {cls.__name__} "
                         f"({type(exc).__name__}: {str(exc).strip()[:500]})") from None
    return apply(model, **({"backend": backend} if backend else {}))


def resolve_device(name: str | None) -> torch.device:
    """--device as a torch.device (default: cuda when available, else cpu); one this machine lacks is a ValueError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    return device
