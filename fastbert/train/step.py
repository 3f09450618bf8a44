"""One optimizer step: forward and backward over this rank's micro-batches, gradient clipping, and the
update, skipped when the loss or the gradient is not finite (or the fp16 loss scaler overflowed).

Nothing in a step waits for the device: the loss sums, the gradient norm and the non-finite checks
stay device tensors (metrics.Window reads them once per metrics line), a bad update is skipped on
the device (the optimizer's found_inf, as torch's fused optimizers take it), and what the host knows
about a batch (its masked tokens, sequences, tokens and FLOPs) is counted on the host, in the loader
thread (host_stats). The model's input checks stay on (validate=True): they run on the device.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastbert.data.examples import MLM_NSP
from fastbert.data.masking import IGNORE_INDEX
from fastbert.train import distributed
from fastbert.train.metrics import training_flops
from fastbert.train.optim import clip_gradients, update

if TYPE_CHECKING:  # run.py is above this module (it builds the Run a step takes)
    from fastbert.train.run import Run


@dataclass
class HostStats:
    """What the host knows of this rank's micro-batches of one step (they are still on the host)."""
    masked: list[int]  # labelled tokens of each micro-batch
    shown_masked: list[int]  # of those, the ones shown as [MASK]
    sequences: list[int]  # rows of each micro-batch
    tokens: int  # real (not padding) tokens, all micro-batches
    flops: float  # training FLOPs (metrics.training_flops), all micro-batches
    most_labelled: int  # the most labelled tokens of one sequence


def host_stats(micro_batches: list[dict], config, mask_id: int, objective: str = MLM_NSP) -> HostStats:
    masked = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]
    shown_masked = [int(((mb["labels"] != IGNORE_INDEX) & (mb["input_ids"] == mask_id)).sum()) for mb in micro_batches]
    lengths = [mb["attention_mask"].sum(1) for mb in micro_batches]
    most = max(int((mb["labels"] != IGNORE_INDEX).sum(1).max()) for mb in micro_batches)
    return HostStats(masked, shown_masked, [mb["input_ids"].shape[0] for mb in micro_batches],
                     int(sum(n.sum() for n in lengths)),
                     sum(training_flops(config, n, m, objective) for n, m in zip(lengths, masked)), most)


@dataclass
class StepResult:
    """Device tensors, none read by the step."""
    sums: torch.Tensor  # float64 [5]: MLM loss, NSP loss, MLM correct, NSP correct, MLM correct at [MASK],
    # summed over the global batch (the NSP terms 0 for the mlm objective)
    grad_norm: torch.Tensor  # 0-d, before clipping
    skipped: torch.Tensor  # bool 0-d: the update was not applied
    bad: torch.Tensor  # bool 0-d: a non-finite loss or gradient (fp16 overflows alone are the scaler's business)
    loss_finite: torch.Tensor  # bool 0-d


def train_step(run: Run, micro_batches: list[dict], host: HostStats, masked_global: float) -> StepResult:
    """masked_global: labelled tokens of the global batch, all ranks together (the MLM loss's divisor).
    With the mlm objective the model has no NSP head and the loss is the MLM loss alone."""
    env, cfg, scaler, optimizer = run.env, run.cfg, run.scaler, run.optimizer
    autocast = torch.autocast(env.device.type, dtype=run.dtype, enabled=run.dtype != torch.float32)
    mask_id = run.phases[0].collator.mask_id
    sums = torch.zeros(5, dtype=torch.float64, device=env.device)
    zero = torch.zeros((), device=env.device)  # the mlm objective's NSP terms
    for i, (mb, masked, shown_masked, rows) in enumerate(zip(micro_batches, host.masked, host.shown_masked,
                                                             host.sequences)):
        mb = {k: v.to(env.device, non_blocking=True) for k, v in mb.items()}
        with distributed.gradient_sync(run.wrapped, i == len(micro_batches) - 1):
            with autocast:
                output = run.wrapped(**mb, return_logits=False, mask_token_id=mask_id)
                if cfg.objective == MLM_NSP:
                    terms = (output.mlm_loss, output.mlm_accuracy, output.mlm_mask_accuracy, output.nsp_loss,
                             output.nsp_accuracy)
                else:
                    terms = (output.loss, output.accuracy, output.mask_accuracy, zero, zero)
            mlm_loss, mlm_accuracy, mask_accuracy, nsp_loss, nsp_accuracy = terms
            mlm_sum, nsp_sum = mlm_loss.float() * masked, nsp_loss.float() * rows
            loss = (mlm_sum / masked_global + nsp_sum / cfg.batch_size) * env.world_size
            scaler.scale(loss).backward()
        sums += torch.stack([mlm_sum.detach().double(), nsp_sum.detach().double(),
                             mlm_accuracy.detach().double() * masked, nsp_accuracy.detach().double() * rows,
                             mask_accuracy.detach().double() * shown_masked])
    sums = distributed.all_reduce_sum(sums, env)  # over the global batch
    scaler.unscale_(optimizer)
    norm = distributed.full_tensor(clip_gradients(run.model, cfg.max_grad_norm))
    loss_finite = torch.isfinite(sums).all()
    skipped = ~(loss_finite & torch.isfinite(norm))
    update(optimizer, skipped)
    if scaler.is_enabled():
        scaler.update()  # lowers the scale after an overflow, from the checks unscale_ recorded
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped first update makes torch warn about the order
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        run.scheduler.step()
    return StepResult(sums, norm, skipped, ~loss_finite if scaler.is_enabled() else skipped, loss_finite)
