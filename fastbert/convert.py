"""`fastbert convert SRC DST [--check]`: load any HF BERT directory fastbert reads (safetensors or .bin,
sharded or not, legacy gamma/beta names), write it back as a clean HF directory (config.json +
model.safetensors + the tokenizer files), and with --check compare fastbert on DST against transformers
on SRC on a padded random batch. A SRC that cannot be copied faithfully (missing, unreadable or
incomplete weights, a config that is not BERT's, DST equal to SRC) is an error and DST is left as it was;
DST is written aside and renamed into place."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import torch

from fastbert.command import run_command
from fastbert.config import BertConfig
from fastbert.files import output_lock, replaced_directory
from fastbert.finetune.loading import checkpoint_directory, load_checkpoint
from fastbert.hub import TOKENIZER_FILES
from fastbert.modeling import MODEL_CLASSES

CHECK_TOLERANCE = 1e-4  # fp32, absolute, on real (non-padding) tokens
logger = logging.getLogger("fastbert.convert")


def model_class_name(path: str) -> str:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        names = [n for n in json.load(f).get("architectures") or [] if n in MODEL_CLASSES]
    return names[0] if names else "BertModel"


def check_against_transformers(src: str, dst: str, name: str) -> float:
    """Max abs difference of the first output between transformers(src) and fastbert(dst), real tokens only."""
    import transformers

    theirs = getattr(transformers, name).from_pretrained(src, dtype=torch.float32).eval()
    ours = MODEL_CLASSES[name].from_pretrained(dst).float().eval()
    config = BertConfig.from_json(dst)
    generator = torch.Generator().manual_seed(0)
    seqlen = min(64, config.max_position_embeddings)
    ids = torch.randint(1, config.vocab_size, (4, seqlen), generator=generator)
    lengths = torch.tensor([seqlen, seqlen // 2, 3, 1])
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        a = theirs(input_ids=ids * mask, attention_mask=mask)[0]
        b = ours(input_ids=ids * mask, attention_mask=mask)[0]
    if a.dim() == 3 and a.shape[:2] == mask.shape:
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
    name = model_class or model_class_name(src)
    model, info = load_checkpoint(MODEL_CLASSES[name], src, "SRC")
    missing = sorted(info["missing_keys"])
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
    parser.add_argument("src", help="HF BERT checkpoint directory (or hub id) to read")
    parser.add_argument("dst", help="directory to write (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--model-class", choices=sorted(MODEL_CLASSES),
                        help="class to load as (default: config.json's architectures, else BertModel)")
    parser.add_argument("--check", action="store_true", help="compare against transformers (needs it installed)")
    args = parser.parse_args(argv)
    return run_command("convert", lambda: convert(args.src, args.dst, args.model_class, args.check))
