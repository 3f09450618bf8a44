# Argument checks shared by the kernel launchers and fastbert.ops, which checks them before choosing the kernel
# or the reference: the attention's optional features (kernels/attention.py) and the cross entropy's shapes and
# options (kernels/mlm_loss.py). Imports only torch, so
# fastbert.ops imports it where Triton is not installed.
import math

import torch


def check_relative_bias(relative_bias, relative_buckets, heads: int, device=None) -> None:
    """relative_bias float [num_buckets, heads] and relative_buckets int32 [2D + 1] (on `device` where given),
    or both None. Bucket values are not read: that would wait for the GPU."""
    if (relative_bias is None) != (relative_buckets is None):
        given, missing = ("relative_bias", "relative_buckets") if relative_buckets is None else (
            "relative_buckets", "relative_bias")
        raise ValueError(f"{given} was given without {missing}: the relative-position bias needs both")
    if relative_bias is None:
        return
    if relative_bias.dim() != 2 or relative_bias.shape[0] < 1 or relative_bias.shape[1] != heads:
        raise ValueError(f"relative_bias has shape {tuple(relative_bias.shape)}, expected [num_buckets >= 1, "
                         f"heads = {heads}]")
    if not relative_bias.is_floating_point():
        raise ValueError(f"relative_bias has dtype {relative_bias.dtype}, expected a floating dtype")
    if relative_buckets.dtype != torch.int32 or relative_buckets.dim() != 1 or relative_buckets.numel() % 2 != 1:
        raise ValueError(f"relative_buckets must be int32 [2 * max_distance + 1] (an odd length), got "
                         f"{relative_buckets.dtype} {tuple(relative_buckets.shape)}")
    for name, tensor in (("relative_bias", relative_bias), ("relative_buckets", relative_buckets)):
        if device is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, q on {device}; all must share one device")


def check_rotary_window(rotary_base, window, head_dim: int) -> None:
    """rotary_base a finite number > 0 (RoPE's theta; the head dim even: its two halves rotate together) or
    None, window an int >= 0 or None."""
    if rotary_base is not None:
        if isinstance(rotary_base, bool) or not isinstance(rotary_base, (int, float)) or not 0 < rotary_base < math.inf:
            raise ValueError(f"rotary_base must be a finite number > 0 (RoPE's theta), got {rotary_base!r}")
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim (its two halves rotate together), got {head_dim}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be an int >= 0 (keys with |i - j| <= window), got {window!r}")


def check_max_seqlen(max_seqlen, tokens: int) -> None:
    """max_seqlen of packed sequences: an int >= 0, >= 1 when there are tokens. That it reaches the longest
    sequence is not checked: that would read cu_seqlens, waiting for the GPU."""
    if (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 0
            or (max_seqlen == 0 and tokens > 0)):
        raise ValueError(f"max_seqlen must be an int >= the longest sequence (>= 1 when there are tokens), "
                         f"got {max_seqlen!r}")


CROSS_ENTROPY_REDUCTIONS = ("mean", "sum")


def check_cross_entropy_shapes(x, weight, bias, target) -> None:
    """x [N, H], weight [V, H], bias [V] or None, an integer target [N]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [N, H] and weight [V, H] must share H, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},) (weight's vocabulary "
                         f"size)")
    if (target.shape != (x.shape[0],) or target.is_floating_point() or target.is_complex()
            or target.dtype == torch.bool):
        raise ValueError(f"target must be an integer tensor of shape ({x.shape[0]},), "
                         f"got {target.dtype} {tuple(target.shape)}")


def check_cross_entropy_options(reduction, label_smoothing) -> None:
    """reduction "mean" or "sum", label_smoothing in [0, 1] (F.cross_entropy's)."""
    if reduction not in CROSS_ENTROPY_REDUCTIONS:
        raise ValueError(f"reduction must be one of {CROSS_ENTROPY_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
