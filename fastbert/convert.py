"""`fastbert convert SRC DST [--check]`: load any HF checkpoint of BERT or its family (RoBERTa, XLM-RoBERTa,
CamemBERT, ELECTRA, DistilBERT, MPNet) that fastbert reads (safetensors or .bin, sharded or not, legacy
gamma/beta names), write it back as a clean HF directory (config.json + model.safetensors + the tokenizer
files), and with --check compare fastbert on DST against transformers' class on SRC on a padded random
batch. The class is config.json's architectures entry: fastbert's own (BertForMaskedLM, RobertaModel,
ElectraForPreTraining, ...), or for a head fastbert has only through `fastbert.apply`
(RobertaForSequenceClassification, ...) transformers' class, whose check runs it accelerated in place.
A SRC that cannot be copied faithfully (missing, unreadable or incomplete weights, weights the class has no
place for when config.json's architectures names no class fastbert runs, a config of an architecture fastbert
does not build, DST equal to SRC) is an error and DST is left as it was; DST is written aside and renamed into
place. A base model saved without its pooler is copied without one."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import torch

from fastbert.architectures import MODEL_CLASSES, model_class
from fastbert.command import run_command
from fastbert.files import output_lock, replaced_directory
from fastbert.hf import CheckpointError, read_state_dict, takes_add_pooling_layer
from fastbert.finetune.loading import checkpoint_directory, load_checkpoint, load_config, weight_errors
from fastbert.hub import TOKENIZER_FILES

CHECK_TOLERANCE = 1e-4  # fp32, absolute, on real (non-padding) tokens
logger = logging.getLogger("fastbert.convert")


def model_class_name(path: str, config) -> str:
    """config.json's architectures entry that fastbert builds natively, else one that is transformers' head of
    the same architecture (accelerated with fastbert.apply), else the architecture's base model."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        names = json.load(f).get("architectures") or []
    prefix = type(config).__name__.removesuffix("Config")
    for name in names:
        if name in MODEL_CLASSES and MODEL_CLASSES[name].config_class is type(config):
            return name
    for name in names:
        if name.startswith(prefix + "For") and _transformers_class(name) is not None:
            return name
    return model_class(config, "Model").__name__


def _transformers_class(name: str) -> type | None:
    try:
        import transformers
    except ImportError:
        return None
    return getattr(transformers, name, None)


def load_source(name: str, src: str, state: dict, **arguments):
    """(model, loading info) of class `name` from SRC (its tensors `state`, read once) in the dtype they are stored
    in (dtype="auto" would take config.json's): fastbert's class, or transformers' (family heads)."""
    arguments["dtype"] = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    if name in MODEL_CLASSES:
        return load_checkpoint(MODEL_CLASSES[name], src, "SRC", state_dict=state, **arguments)
    try:
        return _transformers_class(name).from_pretrained(src, output_loading_info=True, **arguments)
    except weight_errors() as exc:
        raise ValueError(f"SRC {src}: transformers cannot load the weights as {name} ({type(exc).__name__}: "
                         f"{str(exc).strip()[:500]}); the files are damaged or do not match config.json") from None


def check_inputs(config, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [4, S] of random real tokens (never the padding id, which RoBERTa's
    positions skip) padded with the padding id to lengths S, S/2, 3 and 1; [2, 2, S] for a multiple-choice head."""
    generator = torch.Generator().manual_seed(0)
    seqlen = min(64, config.max_sequence_length)
    pad = config.pad_token_id or 0
    ids = torch.randint(0, config.vocab_size, (4, seqlen), generator=generator)
    ids[ids == pad] = (pad + 1) % config.vocab_size
    lengths = torch.tensor([seqlen, seqlen // 2, 3, 1])
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, pad)
    if name.endswith("ForMultipleChoice"):
        return ids.view(2, 2, seqlen), mask.view(2, 2, seqlen)
    return ids, mask


def check_against_transformers(src: str, dst: str, name: str) -> float:
    """Max abs difference of the first output between transformers(src) and fastbert(dst), real tokens only."""
    import transformers

    from fastbert.in_place import apply

    hf_class = getattr(transformers, name)
    theirs = hf_class.from_pretrained(src, dtype=torch.float32).eval()
    if name in MODEL_CLASSES:
        ours = MODEL_CLASSES[name].from_pretrained(dst).float().eval()
    else:  # transformers' head on fastbert's encoder, in place
        ours = apply(hf_class.from_pretrained(dst, dtype=torch.float32)).eval()
    ids, mask = check_inputs(load_config(dst, "DST"), name)
    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask)[0]
        b = ours(input_ids=ids, attention_mask=mask)[0]
    if a.shape[:mask.dim()] == mask.shape:  # per-token outputs: padded positions are not compared
        a, b = a[mask.bool()], b[mask.bool()]
    return (a - b).abs().max().item()


def convert(src: str, dst: str, model_class: str | None = None, check: bool = False) -> int:
    """Write SRC back to DST as a clean HF directory; with check, compare with transformers (exit 1 on a mismatch).
    Raises ValueError (exit code 2) for anything that would make DST a wrong or partial copy of SRC."""
    src = checkpoint_directory(src, "SRC")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise ValueError(f"DST {dst} is SRC: convert writes a new directory beside the one it reads; "
                         "choose another DST")
    if os.path.exists(dst) and (not os.path.isdir(dst)
                                or os.listdir(dst) and not os.path.isfile(os.path.join(dst, "config.json"))):
        raise ValueError(f"DST {dst} exists and is not a checkpoint directory; it would be replaced as a whole, "
                         "so choose a new or empty one")
    config = load_config(src, "SRC")
    name = model_class or model_class_name(src, config)
    try:
        state = read_state_dict(src)
    except CheckpointError as exc:
        raise ValueError(f"SRC {src}: {exc}") from None
    model, info = load_source(name, src, state)
    missing = sorted(info["missing_keys"])
    pooler_optional = name in MODEL_CLASSES and takes_add_pooling_layer(MODEL_CLASSES[name])
    if missing and all(key.startswith("pooler.") for key in missing) and pooler_optional:
        model, info = load_source(name, src, state, add_pooling_layer=False)  # a base model saved without its pooler
        missing = sorted(info["missing_keys"])
    unexpected = sorted(info["unexpected_keys"])
    # a class config.json's architectures does not name is a guess (the base model), and a head it has no place for
    # would be dropped; a checkpoint that names its class (bert-base-uncased: BertForMaskedLM beside its NSP
    # weights) is copied as that class
    if unexpected and model_class is None and name not in (getattr(config, "architectures", None) or []):
        raise ValueError(f"SRC {src} holds {len(unexpected)} tensors that {name} has no place for "
                         f"({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''}): config.json's "
                         "architectures names no class fastbert runs, so it was a guess; give the class that holds "
                         f"them with --model-class (or {name} to drop them), so nothing was written")
    if missing:
        raise ValueError(f"SRC {src} has no weights for {len(missing)} tensors of {name} "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): "
                         "config.json describes more than the weights hold, or another --model-class fits them; "
                         "DST would hold random weights, so nothing was written")
    copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(src, f))]
    with output_lock(dst), replaced_directory(dst) as partial:
        model.save_pretrained(partial)
        for file in copied:
            shutil.copyfile(os.path.join(src, file), os.path.join(partial, file))
    params = sum(p.numel() for p in model.parameters())
    logger.info(f"{name}: {params / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers, "
                f"hidden {model.config.hidden_size}")
    logger.info(f"wrote {dst} (model.safetensors, config.json{''.join(', ' + f for f in copied)})")
    if not check:
        return 0
    diff = check_against_transformers(src, dst, name)
    verdict = "OK" if diff <= CHECK_TOLERANCE else "MISMATCH"
    print(f"check against transformers: max abs difference {diff:.2e} (limit {CHECK_TOLERANCE:.0e}) {verdict}")
    return 0 if diff <= CHECK_TOLERANCE else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastbert convert", description=__doc__)
    parser.add_argument("src", help="HF checkpoint directory (or hub id) of BERT, RoBERTa, XLM-RoBERTa, CamemBERT, "
                                    "ELECTRA, DistilBERT or MPNet to read")
    parser.add_argument("dst", help="directory to write (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--model-class", choices=sorted(MODEL_CLASSES),
                        help="fastbert class to load as (default: config.json's architectures, else the "
                             "architecture's base model, BertModel, RobertaModel, ...)")
    parser.add_argument("--check", action="store_true", help="compare against transformers (needs it installed)")
    args = parser.parse_args(argv)
    return run_command("convert", lambda: convert(args.src, args.dst, args.model_class, args.check))
