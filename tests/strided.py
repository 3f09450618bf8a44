"""Tensors whose element offsets pass 2**31 without the memory: for the kernels' int64 offset tests."""
import torch


def past_int32(values: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`values` in a view with these element strides, whose offsets pass 2**31. The storage is allocated
    lazily (pages never touched take no memory: a few KiB of a 4-8 GiB allocation), and the view starts
    2**31 elements into it, so an offset wrapped to int32 reads zeros there instead of faulting."""
    reach = sum((size - 1) * stride for size, stride in zip(values.shape, strides)) + 1
    assert reach > 2**31, "the strides do not reach past 2**31"
    view = torch.empty(2**31 + reach, dtype=values.dtype, device=values.device).as_strided(
        values.shape, strides, 2**31)
    return view.copy_(values)
