"""The exact memory of one training step (or one inference forward) on an H100, planned without a GPU.

`plan_step` runs the step on meta tensors that stand for CUDA tensors (`meta_gpu.planned_gpu`: fastbert's
Triton launchers through the stand-in driver, CUDA autocast emulated, SDPA as its flash backend) under a
`MemoryTracker`, with the step's own code where fastbert has it: the optimizers as `fastbert pretrain` builds
them (`train.optim.build_optimizer`: torch's fused AdamW, fastbert's LAMB), gradient clipping and the update
as `train.step` does them (`train.optim.clip_gradients` and `update`). Nothing runs on a device and nothing is
compiled, so a BERT-large step plans in seconds of CPU (`fastbert bench --suite memory --model large
--seq-length 512 --batch 32` plans one).

The step is planned in its steady state: the optimizer state exists before it starts (as from the second
step on), gradients do not (the previous step set them to None). The batch counts as the step's inputs, and so
do the tensors `held` beside it.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from fastbert.simulated.memory_tracker import MemoryTracker
from fastbert.simulated.meta_gpu import autocast, planned_gpu
from fastbert.train.optim import build_optimizer, clip_gradients, update

MODES = ("train", "inference")
OPTIMIZERS = (None, "adamw", "lamb")
PRECISIONS = ("bf16", "fp32", "bf16-weights")  # bf16 autocast with fp32 weights | fp32 | bf16 weights, no autocast
PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepMemory:
    """Bytes of one step; every figure is exact for the code that ran (see MemoryTracker)."""
    peak_bytes: int  # the most bytes live at once, weights and inputs included
    forward_end_bytes: int  # live at the end of the forward (before backward)
    saved_for_backward_bytes: int  # of which autograd keeps for the backward: activations (the 16-bit
    # copies of the weights it keeps under autocast are in peak_breakdown's "weight copies")
    weights_bytes: int
    gradients_bytes: int  # at the end of the backward
    optimizer_bytes: int  # the optimizer's state
    peak_breakdown: dict[str, int]  # memory_tracker.CATEGORIES -> bytes at the peak
    saved_by_module: dict[str, int]  # module qualified name (e.g. "bert.encoder.layer.0.attention") -> bytes
    phase_of_peak: str  # "forward", "backward" or "optimizer"


@dataclass(frozen=True)
class OptimizerSettings:
    """What build_optimizer and the step's clipping take; `fastbert pretrain`'s defaults (PretrainConfig).
    None of it changes a byte, but the optimizers are built as pretraining builds them."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0


def plan_step(model: nn.Module, batch: dict[str, torch.Tensor], *, mode: str = "train",
              optimizer: str | None = "adamw", precision: str = "bf16",
              loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
              settings: OptimizerSettings = OptimizerSettings(), held: Sequence[torch.Tensor] = ()) -> StepMemory:
    """Plan one step of `model` on `batch`, both on the meta device.

    model: a fastbert model (config.backend "auto" plans the paths the H100 runs, fastbert.paths; "triton" the
    kernels; "torch" the reference)
    or a transformers one, built under `torch.device("meta")`; its parameters stay where they are (for
    "bf16-weights" they are cast and cast back). batch: the forward's keyword arguments, meta tensors (with
    labels in "train" mode unless loss_fn computes the loss). mode: "train" (forward, backward, clipping, the
    optimizer step) or "inference" (a no_grad forward in eval mode). optimizer: "adamw", "lamb" or None
    (forward and backward only). loss_fn(model, batch) -> 0-d loss; default: the output's .loss (fastbert
    models are called as pretraining calls them: return_logits=False, validate=False). held: meta tensors the
    caller keeps alive through the step without passing them to the forward (an input one model drops and another
    reads, so that it costs both the same); counted as inputs, like the batch.

    Raises ValueError naming a bad argument, a non-meta tensor, or an output without a loss; RuntimeError
    (from the tracker) when fastbert's Triton path is planned in a process with TRITON_INTERPRET=1.
    """
    _check_arguments(model, batch, held, mode, optimizer, precision)
    inputs = [*batch.values(), *held]
    autocast_dtype = torch.bfloat16 if precision == "bf16" else None
    loss_fn = loss_fn or default_loss
    with planned_gpu(), _weights_in(model, torch.bfloat16 if precision == "bf16-weights" else None), \
            _training_mode_kept(model):
        region = autocast(autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        if mode == "inference":
            model.eval()
            with torch.no_grad(), MemoryTracker([model], inputs=inputs) as tracker:
                with region:
                    output = model(**batch, **_accepted(model, validate=False))
                tracker.mark("forward")
                del output
        else:
            model.train()
            opt = _steady_optimizer(model, optimizer, settings) if optimizer else None
            with MemoryTracker([model], opt, inputs=inputs) as tracker:
                with region:
                    loss = loss_fn(model, batch)
                tracker.mark("forward")
                loss.backward()
                tracker.mark("backward")
                if opt is not None:
                    optimizer_step(model, opt, settings)
                tracker.mark("optimizer")
    forward_end = tracker.snapshot("forward")
    after_backward = tracker.snapshot("backward") if mode == "train" else forward_end
    return StepMemory(
        peak_bytes=tracker.peak_bytes, forward_end_bytes=forward_end.total_bytes,
        saved_for_backward_bytes=forward_end.categories["activations"],
        weights_bytes=forward_end.categories["weights"], gradients_bytes=after_backward.categories["gradients"],
        optimizer_bytes=forward_end.categories["optimizer"], peak_breakdown=tracker.peak_snapshot().categories,
        saved_by_module=forward_end.saved_by_module,
        phase_of_peak=tracker.phase_at_peak(list(PHASES[:1] if mode == "inference" else PHASES)))


def default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The output's .loss; fastbert models skip the logits and the input checks (which read data), as
    `fastbert pretrain` calls them. Raises ValueError when the output has no loss."""
    loss = getattr(model(**batch, **_accepted(model, return_logits=False, validate=False)), "loss", None)
    if loss is None:
        raise ValueError(f"{type(model).__name__}'s output has no loss: give labels in the batch or a loss_fn")
    return loss


def _accepted(model: nn.Module, **options) -> dict:
    """The options that model.forward takes (fastbert's own: validate reads the data, which meta lacks): those
    it names, or all for a fastbert model whose forward passes keywords on (ModernBERT's, DistilBERT's, ...)."""
    from fastbert.modeling import BertPreTrainedModel

    parameters = inspect.signature(model.forward).parameters
    passes_on = any(p.kind == p.VAR_KEYWORD for p in parameters.values()) and isinstance(model, BertPreTrainedModel)
    return {name: value for name, value in options.items() if name in parameters or passes_on}


def _check_arguments(model, batch, held, mode, optimizer, precision) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    named_held = ((f"held[{i}]", tensor) for i, tensor in enumerate(held))
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers(), batch.items(), named_held):
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            raise ValueError(f"{name} is on {tensor.device}, expected the meta device (build the model under "
                             "torch.device('meta') and the batch with device='meta')")


@contextlib.contextmanager
def _weights_in(model: nn.Module, dtype: torch.dtype | None):
    """The model's floating parameters and buffers in dtype while entered (None: as they are)."""
    if dtype is None:
        yield
        return
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()]
    original = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.to(dtype)
    try:
        yield
    finally:
        for t, was in zip(tensors, original):
            t.data = t.data.to(was)


@contextlib.contextmanager
def _training_mode_kept(model: nn.Module):
    was_training = model.training
    try:
        yield
    finally:
        model.train(was_training)


def _steady_optimizer(model: nn.Module, name: str, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer pretraining builds, with its state made by one step on zero gradients."""
    opt = build_optimizer(model, name, settings.lr, settings.betas, settings.eps, settings.weight_decay,
                          sharded=False)
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, settings: OptimizerSettings) -> None:
    """Clip, update and clear the gradients as train.step.train_step does (no loss scaling: bf16 and fp32
    need none)."""
    norm = clip_gradients(model, settings.max_grad_norm)
    update(opt, ~torch.isfinite(norm))
    opt.zero_grad(set_to_none=True)
