"""fastbert.last_mask: what attention derives from a key mask, made once per mask (not per layer) and anew when
it could be stale; and the PyTorch path's attention using it."""
import gc
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastbert import reference
from fastbert.last_mask import LastMask


def _aten_ops(call):
    """(call's result, the names of the aten ops it ran), counted by the profiler (a dispatch mode would be a
    trace, where nothing is kept)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = call()
    return result, [event.name for event in profile.events() if event.name.startswith("aten::")]


def test_kept_per_mask_version_and_key():
    cache, made = LastMask(), []

    def make():
        made.append(1)
        return object()

    mask = torch.tensor([[1, 1, 0]])
    first = cache.get(mask, torch.float32, make)
    assert cache.get(mask, torch.float32, make) is first and len(made) == 1
    assert cache.get(mask, torch.bfloat16, make) is not first  # another key
    again = cache.get(mask, torch.bfloat16, make)
    mask[0, 2] = 1  # an in-place change bumps the version
    assert cache.get(mask, torch.bfloat16, make) is not again
    equal = torch.tensor([[1, 1, 1]])  # equal values, another tensor
    assert cache.get(equal, torch.bfloat16, make) is not cache.get(mask, torch.bfloat16, make)
    assert len(made) == 5


def test_never_kept_for_an_inference_tensor_a_dead_mask_or_a_trace():
    cache = LastMask()
    with torch.inference_mode():
        static = torch.tensor([[1, 0]])
        first = cache.get(static, None, object)
        assert cache.get(static, None, object) is not first  # no version to tell a refilled buffer
    mask = torch.tensor([[1, 0]])
    kept = weakref.ref(cache.get(mask, None, lambda: torch.zeros(1)))
    del mask
    gc.collect()
    assert kept() is None  # let go with the mask
    mask = torch.tensor([[1, 0]])
    kept = cache.get(mask, None, object)
    with FakeTensorMode():  # a dispatch mode: what is made belongs to the trace
        assert cache.get(mask, None, object) is not kept
    assert cache.get(mask, None, object) is kept


def test_reference_attention_derives_the_mask_once_per_forward():
    """Every layer passes the same mask: the additive bias and the query multiplier are made by the first call
    only, and the outputs equal those of fresh masks."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out1, first = _aten_ops(lambda: reference.attention(q, k, v, mask, training=False))
    out2, second = _aten_ops(lambda: reference.attention(q, k, v, mask, training=False))
    assert first.count("aten::masked_fill") == 1 and "aten::masked_fill" not in second
    assert len(second) < len(first)
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    torch.testing.assert_close(out2, reference.attention(q, k, v, mask.clone(), training=False), rtol=0, atol=0)
    assert (out1[1, :, 2:] == 0).all()  # padded queries still zeros


def test_reference_varlen_derives_the_padded_layout_once():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 8, generator=g) for _ in range(3))
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    out1, first = _aten_ops(lambda: reference.attention_varlen(q, k, v, cu_seqlens, 3, training=False))
    out2, second = _aten_ops(lambda: reference.attention_varlen(q, k, v, cu_seqlens, 3, training=False))
    assert first.count("aten::searchsorted") == 1 and "aten::searchsorted" not in second
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    fresh = reference.attention_varlen(q, k, v, cu_seqlens.clone(), 3, training=False)
    torch.testing.assert_close(out2, fresh, rtol=0, atol=0)


def test_reference_local_layers_share_the_mask_and_band():
    """ModernBERT's local layers add the window's band to the key mask's bias: made once per mask, dtype and
    window, equal to the terms made fresh."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    first = reference._score_bias(q, mask, None, None, window=2)
    assert reference._score_bias(q, mask, None, None, window=2) is first
    assert reference._score_bias(q, mask, None, None, window=3) is not first
    fresh = reference._key_mask_bias(mask.clone(), q.dtype) + reference._band(q, 2)
    torch.testing.assert_close(first, fresh, rtol=0, atol=0)
    assert first.shape == (2, 1, 6, 6) and first[1, 0, 0, 3] == float("-inf") and first[1, 0, 0, 2] == 0
