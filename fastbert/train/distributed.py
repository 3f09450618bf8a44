"""Process group and model wrapping for `torchrun` runs: DDP (default) or FSDP2 `fully_shard`.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (multi-node through its rendezvous); without them the
run is a single process. The backend is nccl on GPU, gloo on CPU.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "fsdp")


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    host_group: object = None  # gloo group for host-side agreement (None: the default group is gloo already)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


def init(device: str = "auto") -> Dist:
    """Join torchrun's process group when WORLD_SIZE > 1 (unless already joined); one process otherwise."""
    kind = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if kind.type == "cuda":
        torch.cuda.set_device(local)
        kind = torch.device("cuda", local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if kind.type == "cuda" else "gloo")
    if dist.is_initialized():
        host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        return Dist(dist.get_rank(), dist.get_world_size(), local, kind, host_group)
    return Dist(device=kind)


def wrap(model: torch.nn.Module, strategy: str, env: Dist, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """DDP, or FSDP2 with one shard group per encoder layer plus the root (embeddings and heads, which
    share the tied word-embedding matrix). param_dtype: FSDP2's compute dtype for parameters (bf16
    or fp16 halves the all-gathers); gradients are reduced in fp32."""
    if strategy not in STRATEGIES:
        raise ValueError(f"distributed strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not env.distributed:
        return model
    if strategy == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        # an untied MLM head's own bias is unused, as in transformers (the logits add the decoder's): DDP must not
        # wait for its gradient, which never comes
        untied = not getattr(model.config, "tie_word_embeddings", True)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=untied)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """No gradient all-reduce / reduce-scatter inside (accumulation micro-steps) unless enabled."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def all_reduce_sum(tensor: torch.Tensor, env: Dist) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(tensor)
    return tensor


def host_sum(values: list[float], env: Dist) -> list[float]:
    """Sum host numbers over the ranks through a CPU (gloo) collective: the device's queue is not waited for."""
    if not env.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=env.host_group)
    return tensor.tolist()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 DTensor shard (a collective: every rank calls it), else t."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
