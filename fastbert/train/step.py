"""One optimizer step: forward and backward over this rank's micro-batches, gradient clipping, and the
update, skipped when the loss or the gradient is not finite (or the fp16 loss scaler overflowed)."""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import torch

from fastbert.data.masking import IGNORE_INDEX
from fastbert.train import distributed
from fastbert.train.metrics import STATS, training_flops
from fastbert.train.run import Run


@dataclass
class StepResult:
    stats: torch.Tensor  # [len(STATS)] float64 sums over the global batch; loss terms zeroed when not finite
    grad_norm: float  # before clipping
    updated: bool  # the optimizer applied the update
    bad: bool  # a non-finite loss or gradient (fp16 overflows alone are not bad: the scaler handles them)


def masked_counts(micro_batches: list[dict]) -> list[int]:
    """Labelled (masked) tokens of each micro-batch."""
    return [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]


def train_step(run: Run, micro_batches: list[dict], counts: list[int], masked_global: float) -> StepResult:
    """masked_global: labelled tokens of the global batch, all ranks together (the MLM loss's divisor)."""
    env, cfg, scaler, optimizer = run.env, run.cfg, run.scaler, run.optimizer
    autocast = torch.autocast(env.device.type, dtype=run.dtype, enabled=run.dtype != torch.float32)
    stats = torch.zeros(len(STATS), dtype=torch.float64, device=env.device)
    for i, (mb, count) in enumerate(zip(micro_batches, counts)):
        flops = training_flops(run.config, mb["attention_mask"].sum(1), count)
        rows = mb["input_ids"].shape[0]
        tokens = int(mb["attention_mask"].sum())
        mb = {k: v.to(env.device, non_blocking=True) for k, v in mb.items()}
        with distributed.gradient_sync(run.wrapped, i == len(micro_batches) - 1):
            with autocast:
                output = run.wrapped(**mb, return_logits=False, validate=False)
            mlm_sum = output.mlm_loss.float() * count
            nsp_sum = output.nsp_loss.float() * rows
            loss = (mlm_sum / masked_global + nsp_sum / cfg.batch_size) * env.world_size
            scaler.scale(loss).backward()
        stats += torch.stack([mlm_sum.detach().double(), nsp_sum.detach().double(),
                              output.mlm_accuracy.detach().double() * count,
                              output.nsp_accuracy.detach().double() * rows,
                              *torch.tensor([count, rows, tokens, flops], dtype=torch.float64, device=env.device)])
    stats = distributed.all_reduce_sum(stats, env)  # sums over the global batch
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm or math.inf)
    grad_norm = float(distributed.full_tensor(norm))
    loss_finite = bool(torch.isfinite(stats).all())
    if scaler.is_enabled():  # fp16: the scaler skips an update whose gradients overflowed
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        updated = scaler.get_scale() >= scale  # it lowers the scale exactly when it skips
        bad = not loss_finite
    else:
        bad = not (loss_finite and math.isfinite(grad_norm))
        updated = not bad
        if updated:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped first update makes torch warn about the order
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        run.scheduler.step()
    if not loss_finite:
        stats[:6] = 0  # the loss terms stay out of the averages; tokens and FLOPs were spent
    return StepResult(stats, grad_norm, updated, bad)
