"""Pretraining optimizers and the LR schedule.

LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes")
is the optimizer that trains BERT with large batches; AdamW is the paper's (Adam with decoupled
weight decay 0.01).

Per parameter w with gradient g (Algorithm 2 of the paper, with Adam's bias correction):
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,  m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)
    r = m^ / (sqrt(v^) + eps) + weight_decay * w
    w = w - lr * (||w|| / ||r||) * r          (trust ratio 1 when either norm is 0)
The norms are whole-tensor norms; on FSDP2's sharded DTensor parameters each rank's shard norms are
combined over the mesh (one all-reduce per group), so the result does not depend on the sharding.
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
    """LAMB as above, multi-tensor: each parameter group's update is a fixed number of torch._foreach_*
    calls (about 35), whatever its number of tensors, and nothing is read back to the host (with
    found_inf, one masked_fill per gradient more: 239 operations per step for BERT-base, against 3,058
    for the update written one tensor at a time).

    To skip an update without a host sync, set `optimizer.found_inf` to a 0-d float tensor on the
    parameters' device (1 = skip) before step(), as torch's fused optimizers take it: weights, moments
    and step counts are then left exactly as they were. `grad_scale`, when set (GradScaler does so for
    optimizers with _step_supports_amp_scaling), divides the gradients first.
    """

    _step_supports_amp_scaling = True

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
        # capturable: load_state_dict keeps the step counts on the parameters' device, where step() reads them
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params, getattr(self, "found_inf", None), getattr(self, "grad_scale", None))
        return loss

    def _update(self, group: dict, params: list, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None):
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        weights, grads = _local([p for p in params]), _local([p.grad for p in params])
        exp_avgs, exp_avg_sqs = _local([s["exp_avg"] for s in states]), _local([s["exp_avg_sq"] for s in states])
        if grad_scale is not None:
            torch._foreach_div_(grads, grad_scale)
        advance, decay1, decay2 = 1.0, beta1, beta2
        if found_inf is not None:  # a skipped step: no advance, moments decay by 1 and gain 0
            skip = found_inf.to(torch.bool)
            for g in grads:  # non-finite gradients must not reach the moments (0 * nan is nan)
                g.masked_fill_(skip, 0.0)
            decay1, decay2 = beta1 + (1 - beta1) * found_inf, beta2 + (1 - beta2) * found_inf
            advance = [1 - found_inf] * len(steps)  # a list: one 0-d tensor for all is read on the host on CPU
        torch._foreach_add_(steps, advance)
        torch._foreach_mul_(exp_avgs, decay1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, decay2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        counted = torch._foreach_clamp_min(steps, 1.0)  # a skipped first step leaves 0: nothing to correct
        correction1, correction2 = (_one_minus_power(beta, counted) for beta in (beta1, beta2))
        denom = torch._foreach_div(exp_avg_sqs, correction2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, correction1)
        torch._foreach_div_(update, denom)
        if group["weight_decay"]:
            torch._foreach_add_(update, weights, alpha=group["weight_decay"])
        weight_norm, update_norm = _norms(params, weights, update)  # [N] each
        trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
        scale = trust * -group["lr"]
        if found_inf is not None:
            scale = scale * (1 - found_inf)
        torch._foreach_mul_(update, list(scale.unbind()))
        torch._foreach_add_(weights, update)


def _one_minus_power(beta: float, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """1 - beta ** t for each step count t (0-d tensors): Adam's bias correction."""
    powers = torch._foreach_pow(beta, steps)
    torch._foreach_neg_(powers)
    torch._foreach_add_(powers, 1.0)
    return powers


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local shards of FSDP2's DTensors (in-place updates write through), plain tensors as they are."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _norms(params: list, weights: list[torch.Tensor], update: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-tensor norms of weights and update ([N] each); a sharded parameter's norm sums its shards'
    squares over the ranks of its mesh (FSDP2 shards every parameter on dim 0 of one mesh)."""
    norms = torch.stack(torch._foreach_norm(weights) + torch._foreach_norm(update))  # [2N]
    if hasattr(params[0], "device_mesh"):
        squares = norms.square()
        torch.distributed.all_reduce(squares, group=params[0].device_mesh.get_group())
        norms = squares.sqrt()
    return norms.chunk(2)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: biases and LayerNorm parameters (DistilBERT's *layer_norm) are
    exempt, as in BERT."""
    params = dict(model.named_parameters())
    decay, exempt = param_group_names(model)
    return [{"params": [params[name] for name in decay], "weight_decay": weight_decay},
            {"params": [params[name] for name in exempt], "weight_decay": 0.0}]


def param_group_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of param_groups' parameters, group by group, in the optimizer's order (a checkpoint records
    them, so that its optimizer state maps onto another layout's parameters by name)."""
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (exempt if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name else decay).append(name)
    return [decay, exempt]


def build_optimizer(model: torch.nn.Module, name: str, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, sharded: bool) -> torch.optim.Optimizer:
    """"lamb" (apex FusedLAMB when it imports and nothing is sharded, else fastbert's multi-tensor Lamb) or
    "adamw" (torch's fused AdamW where torch has a fused kernel for the device, foreach otherwise)."""
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
        try:  # fused (one kernel, skips on found_inf without a sync) on every device torch has it for
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except RuntimeError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
    raise ValueError(f"optimizer must be 'lamb' or 'adamw', got {name!r}")


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The gradients' global norm (before clipping), clipped to max_norm unless it is 0."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)


def update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless skip: decided on the device by optimizers that take found_inf (torch's
    fused ones, fastbert's Lamb); the others (apex, torch's foreach) read skip on the host."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = skip.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not skip.item():
        optimizer.step()


def linear_warmup_decay(warmup_steps: int, total_steps: int):
    """LR multiplier: linear from 0 to 1 over warmup_steps, then linear to 0 at total_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return factor
