"""Pretraining optimizers and the LR schedule.

LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes")
is the optimizer that trains BERT with large batches; AdamW is the paper's (Adam with decoupled
weight decay 0.01).

Per parameter w with gradient g (Algorithm 2 of the paper, with Adam's bias correction):
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,  m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)
    r = m^ / (sqrt(v^) + eps) + weight_decay * w
    w = w - lr * (||w|| / ||r||) * r          (trust ratio 1 when either norm is 0)
The norms are whole-tensor norms; on FSDP2's sharded DTensor parameters they are reduced across
ranks by DTensor, so the result does not depend on the sharding.
NVIDIA apex's FusedLAMB (same update, one fused kernel for all tensors) is used instead when apex
imports and the parameters are plain CUDA tensors; apex is never a dependency. It runs with
use_nvlamb=True (apex otherwise skips the trust ratio of parameters without weight decay) and
without its own clipping (max_grad_norm=inf: the training loop clips, and apex's 0 would zero
every gradient rather than disable clipping).
"""
from __future__ import annotations

import math

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                update = (exp_avg / (1 - beta1 ** state["step"])).div_(denom)
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                weight_norm, update_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm,
                                    torch.ones_like(weight_norm))
                p.sub_(update * (trust * group["lr"]))
        return loss


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: biases and LayerNorm parameters are exempt, as in BERT."""
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (exempt if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, name: str, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, sharded: bool) -> torch.optim.Optimizer:
    """"lamb" (apex FusedLAMB when it imports and nothing is sharded, else Lamb) or "adamw" (fused on CUDA
    without sharding, foreach otherwise)."""
    groups = param_groups(model, weight_decay)
    on_cuda = next(model.parameters()).is_cuda
    if name == "lamb":
        if on_cuda and not sharded:
            try:
                from apex.optimizers import FusedLAMB
            except ImportError:
                pass
            else:
                return FusedLAMB(groups, lr=lr, betas=betas, eps=eps, max_grad_norm=math.inf, use_nvlamb=True)
        return Lamb(groups, lr=lr, betas=betas, eps=eps)
    if name == "adamw":
        fast = {"fused": True} if on_cuda and not sharded else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **fast)
    raise ValueError(f"optimizer must be 'lamb' or 'adamw', got {name!r}")


def linear_warmup_decay(warmup_steps: int, total_steps: int):
    """LR multiplier: linear from 0 to 1 over warmup_steps, then linear to 0 at total_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return factor
