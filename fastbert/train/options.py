"""The options of `fastbert pretrain`: PretrainConfig, its checks, and the command line that fills it.

Options are the fields of PretrainConfig, filled from a preset (--preset), then --config FILE (JSON),
then flags; --model.<field> VALUE overrides a BertConfig field.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

from fastbert.config import ACTIVATION_CHECKPOINTING
from fastbert.data.corpus import STDLIB
from fastbert.data.examples import MLM_NSP, OBJECTIVES
from fastbert.train import distributed

PRESETS = ("tiny", "base", "large", "modernbert-base", "modernbert-large")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "lamb")
DEVICES = ("auto", "cpu", "cuda")
AUTO_MICRO_BATCH = "auto"  # --micro-batch-size auto (fastbert.train.run.auto_micro_batches)


# --preset: where the options start before --config and flags. "paper" is PretrainConfig's defaults (the
# paper's recipe); "demo" replaces some of them so that a tiny model visibly learns on the built-in corpus
# (Python's docstrings) in under 3 minutes on 2 CPU cores (MLM accuracy >= 0.15, NSP >= 0.70); "auto" is
# the demo on the built-in corpus and the paper on the user's --data, decided by the value, so that naming a
# default (--data stdlib, --model tiny) changes nothing.
PRESET_CHOICES = ("auto", "demo", "paper")
# One torch thread: torch's default, one per core, spins when other work holds the cores.
DEMO_OPTIONS = {"steps": 1400, "lr": 1.5e-3, "warmup": 0.02, "beta2": 0.98, "seq_lengths": "64", "threads": 1}
# applied to the tiny model only (a narrower feed-forward layer, 4 heads; no dropout for a small model on
# little data): the demo's changes to the model the user did not choose
DEMO_MODEL = {"intermediate_size": 256, "num_attention_heads": 4, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}
DEMO_MODEL_HELP = "the tiny model with 4 heads, FFN 256, no dropout"


# the types PretrainConfig's fields are annotated with: as isinstance reads them (an int is a float too, as in JSON),
# and in words
FIELD_TYPES = {"int": (int, "an integer"), "float": ((int, float), "a number"), "str": (str, "a string"),
               "bool": (bool, "true or false")}


# the options that take one of a few values
CHOICES = {"optimizer": OPTIMIZERS, "objective": OBJECTIVES, "device": DEVICES, "precision": PRECISIONS,
           "activation_checkpointing": ACTIVATION_CHECKPOINTING, "distributed": distributed.STRATEGIES}


@dataclass
class PretrainConfig:
    run_name: str = ""  # directory name under ./runs/; "" = "<model>-<data>"
    out: str = ""  # output directory; "" = ./runs/<run_name>
    data: str = STDLIB  # `fastbert prepare-data` output (holding seq128/, seq512/, ...) or "stdlib" (built in)
    model: str = "tiny"  # tiny | base | large (BERT's sizes) | modernbert-base | modernbert-large, or an HF config.json
    objective: str = MLM_NSP  # mlm+nsp (BERT's) | mlm: masked LM alone on packed full sentences (RoBERTa's)
    steps: int = 400  # optimizer steps in all (the paper: 1,000,000)
    batch_size: int = 32  # global batch: sequences per optimizer step, all ranks together (the paper: 256)
    micro_batch_size: str = ""  # per rank per forward, one or one per phase; "" = all; auto = the most the GPU fits
    seq_lengths: str = ""  # sequence length of each phase; "" = 128,512 (max_position_embeddings/2 and /1 if less)
    phase_fractions: str = ""  # share of the steps of each phase; "" = the paper's 0.9,0.1 for two phases, 1 for one
    optimizer: str = "adamw"  # adamw (the paper's Adam with weight decay) | lamb (large batches)
    lr: float = 1e-4  # peak learning rate (the paper: 1e-4)
    warmup: float = 0.01  # warm-up steps, or a fraction of the steps when < 1 (the paper: 10k of 1M)
    weight_decay: float = 0.01  # decoupled weight decay on weight matrices (not biases, not LayerNorm)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16 (with loss scaling)
    activation_checkpointing: str = "none"  # what each layer recomputes in the backward instead of keeping
    distributed: str = "ddp"  # under torchrun: ddp | fsdp (FSDP2 fully_shard, per layer)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 12345
    mask_prob: float = 0.15  # fraction of tokens predicted
    whole_word_masking: bool = False  # mask whole words (a token and its "##" pieces)
    log_every: int = 10  # steps per metrics line and progress-bar update
    save_every: int = 1000  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2  # newest complete checkpoints kept (>= 2)
    max_bad_steps: int = 20  # consecutive steps with a non-finite loss or gradient that stop the run
    resume: str = "auto"  # auto (newest checkpoint of the output directory, if any) | never | a checkpoint path
    accept_changes: bool = False  # resume even if the model, data or options differ from the checkpoint's run
    stop_at: int = 0  # stop after this step with a checkpoint, to be resumed later; 0 = run to the end
    peak_tflops: float = 0.0  # device peak for MFU in TFLOP/s; 0 = measure a matmul at start
    prefetch: int = 2  # batches prepared ahead in a background thread
    threads: int = 0  # torch threads of the training loop; 0 = torch's default (one per core)
    progress: bool = True  # progress bar on rank 0

    def validate(self) -> None:
        for field in dataclasses.fields(self):  # --config's JSON values too, which argparse never typed
            value, (kind, words) = getattr(self, field.name), FIELD_TYPES[field.type]
            if field.name in CHOICES:  # its check below names the values it takes
                continue
            if not isinstance(value, kind) or (isinstance(value, bool) and field.type != "bool"):
                raise ValueError(f"--{field.name.replace('_', '-')} must be {words}, got {value!r}")
        choices = [(name, getattr(self, name) in values, f"one of {values}") for name, values in CHOICES.items()]
        checks = [*choices, ("steps", self.steps >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
                  ("lr", 0 < self.lr < math.inf, "finite and > 0"),
                  ("warmup", 0 <= self.warmup < math.inf, "finite and >= 0"),
                  ("weight_decay", 0 <= self.weight_decay < math.inf, "finite and >= 0"),
                  ("eps", 0 < self.eps < math.inf, "finite and > 0"),
                  ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
                  ("mask_prob", 0 < self.mask_prob < 1, "in (0, 1)"),
                  ("max_grad_norm", 0 <= self.max_grad_norm < math.inf, "finite and >= 0 (0: no clipping)"),
                  ("log_every", self.log_every >= 1, ">= 1"), ("save_every", self.save_every >= 1, ">= 1"),
                  ("keep_checkpoints", self.keep_checkpoints >= 2, ">= 2"),
                  ("max_bad_steps", self.max_bad_steps >= 1, ">= 1"), ("stop_at", self.stop_at >= 0, ">= 0"),
                  ("peak_tflops", 0 <= self.peak_tflops < math.inf, "finite and >= 0"),
                  ("prefetch", self.prefetch >= 1, ">= 1"),
                  ("threads", self.threads >= 0, ">= 0")]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {limit}, got {getattr(self, name)!r}")


def parse_list(name: str, text: str, kind) -> list:
    """A comma-separated option (e.g. --seq-lengths 128,512) as a list of `kind`."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} must be a comma-separated list of {kind.__name__}, "
                         f"got {text!r}") from None
    if not values:
        raise ValueError(f"--{name.replace('_', '-')} is empty")
    return values


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: list[str], description: str) -> tuple[PretrainConfig, dict]:
    """PretrainConfig from the preset < --config JSON < flags; and the --model.<field> overrides."""
    parser = argparse.ArgumentParser(prog="fastbert pretrain", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--preset", choices=PRESET_CHOICES,
                        help="where the options start: paper = the defaults shown below (the paper's recipe); demo "
                             "= those with the 'demo:' values shown, and " + DEMO_MODEL_HELP + "; auto = demo on "
                             "the built-in corpus (--data stdlib), paper on your --data (default: auto)")
    parser.add_argument("--config", help="JSON file of options (the keys below, and model.<field> keys)")
    comments = _field_comments()
    choices = {"objective": OBJECTIVES, "optimizer": OPTIMIZERS, "precision": PRECISIONS, "device": DEVICES,
               "distributed": distributed.STRATEGIES, "activation_checkpointing": ACTIVATION_CHECKPOINTING}
    for field in dataclasses.fields(PretrainConfig):
        flag = "--" + field.name.replace("_", "-")
        demo = f"; demo: {DEMO_OPTIONS[field.name]!r}" if field.name in DEMO_OPTIONS else ""
        help_text = f"{comments.get(field.name, '')} (default: {field.default!r}{demo})".replace("%", "%%")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            kind = {"int": int, "float": float}.get(field.type, str)
            parser.add_argument(flag, type=kind, choices=choices.get(field.name), help=help_text)
    args, rest = parser.parse_known_args(argv)
    overrides: dict = {}
    values: dict = {}
    if "config" in args:
        try:
            with open(args.config, encoding="utf-8") as f:
                from_file = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--config {args.config!r}: {exc}") from None
        names = {f.name for f in dataclasses.fields(PretrainConfig)} | {"preset"}
        for key, value in from_file.items():
            if key.startswith("model."):
                overrides[key[len("model."):]] = value
            elif key.replace("-", "_") in names:
                values[key.replace("-", "_")] = value
            else:
                raise ValueError(f"--config {args.config!r}: unknown option {key!r}")
    values.update({k: v for k, v in vars(args).items() if k != "config"})
    while rest:
        flag = rest.pop(0)
        if not flag.startswith("--model.") or not rest:
            parser.error(f"unrecognized argument {flag!r} (model fields are set with --model.<field> VALUE)")
        overrides[flag[len("--model."):]] = _parse_value(rest.pop(0))
    values, overrides = apply_preset(values.pop("preset", "auto"), values, overrides)
    return PretrainConfig(**values), overrides


def apply_preset(preset: str, values: dict, overrides: dict) -> tuple[dict, dict]:
    """The options and model overrides given (from --config and flags) over the preset's. Raises ValueError
    for a preset that is not one of PRESET_CHOICES."""
    if preset not in PRESET_CHOICES:
        raise ValueError(f"--preset must be one of {PRESET_CHOICES}, got {preset!r}")
    if preset == "auto":
        preset = "demo" if values.get("data", STDLIB) == STDLIB else "paper"
    if preset == "paper":
        return values, overrides
    model = {**DEMO_MODEL, **overrides} if values.get("model", "tiny") == "tiny" else overrides
    return {**DEMO_OPTIONS, **values}, model


def _field_comments() -> dict[str, str]:
    """The comment after each PretrainConfig field, used as its --help text."""
    import inspect
    comments = {}
    for line in inspect.getsource(PretrainConfig).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest and name.isidentifier():
            comments[name] = rest.split("#", 1)[1].strip()
    return comments
