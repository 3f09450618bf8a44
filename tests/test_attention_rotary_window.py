"""ModernBERT's rotary positions (ROTARY) and sliding window (WINDOW) in kernels/attention.py, on CPU under
TRITON_INTERPRET=1: the output and dq, dk, dv against the float64 reference with DESIGN.md's tolerance rule
(fp32/fp16/bf16, S = 7, 37, 129, windows 0, 1, 5, 64 and wider than S, head dims 32 and 64, padded with random
lengths, a fully padded and a length-1 sequence, packed), rotary alone, window alone and both; the reference
against transformers' ModernBERT attention math (its rotary embedding, apply_rotary_pos_emb and sliding-window
mask); the band's block ranges; the packed layout equal to the padded one bitwise; dropout's mask shared by the
forward and the backward; determinism; torch.compile; argument errors."""
import pytest
import torch
import triton
import triton.language as tl
from transformers import ModernBertConfig
from transformers.masking_utils import create_bidirectional_sliding_window_mask
from transformers.models.modernbert.modeling_modernbert import (ModernBertRotaryEmbedding, apply_rotary_pos_emb,
                                                                eager_attention_forward)

from fastbert import ops, reference
from fastbert.kernels import attention as attn
from test_attention import recover_dropout_keep, run
from tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, assert_within_rule

LOCAL_THETA, GLOBAL_THETA = 10_000.0, 160_000.0  # ModernBERT's local and global layers' rotary bases


def make_lengths(batch, seqlen):
    """Random lengths in [1, S] with sequence 1 empty and sequence 2 of length 1 (batch >= 3)."""
    lengths = torch.randint(1, seqlen + 1, (batch,))
    lengths[1], lengths[2] = 0, 1
    return lengths


def make_inputs(batch, heads, seqlen, head_dim, dtype, device):
    """q, k, v [B, heads, S, d] as differentiable views of one [B, S, 3, heads, d] buffer (a fused QKV
    projection's layout) and an output gradient."""
    buffer = torch.randn(batch, seqlen, 3, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype)
    return (*buffer.permute(2, 0, 3, 1, 4).unbind(0), dout)


def assert_matches_reference(kernel_fn, reference_fn, inputs, dout):
    """kernel_fn(*inputs) and dq, dk, dv within the rule of reference_fn in float64 (exact) and in the
    inputs' dtype (PyTorch's own error). Returns the kernel's (out, grads)."""
    out, grads = run(kernel_fn, inputs, dout)
    exact_out, exact_grads = run(reference_fn, [t.detach().double().requires_grad_() for t in inputs], dout.double())
    torch_out, torch_grads = run(reference_fn, [t.detach().clone().requires_grad_() for t in inputs], dout)
    assert_within_rule("out", out, torch_out, exact_out, FORWARD_FACTOR)
    for name, grad, torch_grad, exact_grad in zip(("dq", "dk", "dv"), grads, torch_grads, exact_grads):
        assert_within_rule(name, grad, torch_grad, exact_grad, GRADIENT_FACTOR)
    return out, grads


# Every length, window, dtype and head dim appears, with rotary alone, the window alone and both; not their full
# product (the interpreter is slow). Windows 64 at S = 7 and 37 are wider than the sequence; 0 keeps the diagonal.
CASES = [
    # (S, dtype, head_dim, rotary_base, window)
    (7, torch.float32, 32, GLOBAL_THETA, None),
    (7, torch.bfloat16, 64, LOCAL_THETA, 1),
    (37, torch.float32, 64, None, 5),
    (37, torch.float16, 32, LOCAL_THETA, 64),
    (37, torch.bfloat16, 32, LOCAL_THETA, 0),
    (129, torch.float32, 64, LOCAL_THETA, 5),
    (129, torch.float16, 64, GLOBAL_THETA, None),
    (129, torch.bfloat16, 32, None, 64),
    (129, torch.float16, 32, LOCAL_THETA, 1),
]


@pytest.mark.parametrize("seqlen,dtype,head_dim,rotary_base,window", CASES, ids=str)
def test_padded_matches_reference(device, seqlen, dtype, head_dim, rotary_base, window):
    torch.manual_seed(seqlen + head_dim)
    batch, heads = 3, 2
    *qkv, dout = make_inputs(batch, heads, seqlen, head_dim, dtype, device)
    mask = (torch.arange(seqlen)[None, :] < make_lengths(batch, seqlen)[:, None]).to(device)
    out, grads = assert_matches_reference(
        lambda q, k, v: attn.attention(q, k, v, mask, rotary_base=rotary_base, window=window),
        lambda q, k, v: reference.attention(q, k, v, mask, rotary_base=rotary_base, window=window), qkv, dout)
    # the fully padded sequence: zeros, and zero gradients
    assert (out[1] == 0).all() and all((grad[1] == 0).all() for grad in grads)


@pytest.mark.parametrize("seqlen,dtype,head_dim,rotary_base,window", [
    (37, torch.float32, 32, LOCAL_THETA, 5), (129, torch.bfloat16, 64, LOCAL_THETA, 64),
    (129, torch.float16, 32, None, 1), (37, torch.bfloat16, 64, GLOBAL_THETA, None)], ids=str)
def test_packed_matches_reference(device, seqlen, dtype, head_dim, rotary_base, window):
    """Several packed sequences (an empty one, one of length 1): positions restart at every sequence."""
    torch.manual_seed(seqlen + 1)
    heads = 2
    lengths = make_lengths(4, seqlen)
    lengths[0] = seqlen  # the longest is max_seqlen
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
    total = int(lengths.sum())
    qkv = [torch.randn(total, heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    dout = torch.randn(total, heads, head_dim, device=device, dtype=dtype)
    assert_matches_reference(
        lambda q, k, v: attn.attention_varlen(q, k, v, cu_seqlens, seqlen, rotary_base=rotary_base, window=window),
        lambda q, k, v: reference.attention_varlen(q, k, v, cu_seqlens, seqlen, rotary_base=rotary_base,
                                                   window=window), qkv, dout)


def transformers_attention(q, k, v, mask, config, layer_type):
    """ModernBertAttention's math after its Wqkv, as transformers 5 runs it on the eager path: its rotary
    embedding's cos / sin of the layer type, apply_rotary_pos_emb, the model's mask for the layer type (for
    "sliding_attention", create_bidirectional_sliding_window_mask, built as ModernBertModel.forward builds it)
    and eager_attention_forward. q, k, v [B, heads, S, d]; returns [B, heads, S, d]."""
    batch, heads, seqlen, head_dim = q.shape
    embeds = q.new_zeros(batch, seqlen, heads * head_dim)
    position_ids = torch.arange(seqlen, device=q.device)[None]
    cos, sin = ModernBertRotaryEmbedding(config, device=q.device)(embeds, position_ids, layer_type)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    if layer_type == "sliding_attention":
        additive = create_bidirectional_sliding_window_mask(config=config, inputs_embeds=embeds, attention_mask=mask)
    else:
        additive = torch.where(mask[:, None, None, :].bool(), 0.0, torch.finfo(q.dtype).min)
    module = torch.nn.Module()
    module.training = False
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=head_dim ** -0.5)
    return out.transpose(1, 2)


def test_inverse_frequencies_are_transformers_and_made_once(device):
    """The kernels' rotary inverse frequencies equal transformers' ModernBERT buffers bitwise, for both layer
    types, and are made once per device, head dim and base: every later attention call (each layer, forward and
    backward) gets the same tensor instead of four torch ops."""
    config = ModernBertConfig(hidden_size=128, num_attention_heads=2)
    rotary = ModernBertRotaryEmbedding(config, device=device)
    unread = attn.placeholders(torch.device(device))
    q = torch.empty(1, 2, 4, 64, device=device)
    for layer_type, theta in (("sliding_attention", LOCAL_THETA), ("full_attention", GLOBAL_THETA)):
        made = attn._inv_freq(q, theta, unread)
        assert torch.equal(made, getattr(rotary, f"{layer_type}_inv_freq"))
        assert attn._inv_freq(q, theta, unread) is made
    assert attn._inv_freq(q[..., :32], LOCAL_THETA, unread).shape == (16,)  # another head dim, its own tensor
    assert attn._inv_freq(q, None, unread) is unread[torch.float32]  # no rotary positions: the placeholder


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_reference_rotate_is_rotate_half_bitwise(dtype, device):
    """rotate's roll and signed sine give transformers' x * cos + rotate_half(x) * sin exactly, forward and
    backward, at the same angles (computed here as transformers' rotary embedding lays them out)."""
    from transformers.models.modernbert.modeling_modernbert import rotate_half

    x = torch.randn(2, 3, 7, 64, device=device).to(dtype).requires_grad_()
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (LOCAL_THETA ** (torch.arange(0, 64, 2, device=device, dtype=torch.int64).to(work) / 64))
    angles = torch.arange(7, device=device, dtype=work)[:, None] * inv_freq[None]
    both = torch.cat([angles, angles], dim=-1)
    widened = x.to(work)
    expected = (widened * both.cos() + rotate_half(widened) * both.sin()).to(dtype)
    got = reference.rotate(x, LOCAL_THETA)
    cotangent = torch.randn_like(got)
    assert torch.equal(got, expected)
    assert torch.equal(*(torch.autograd.grad(y, x, cotangent)[0] for y in (got, expected)))


def test_reference_rotary_tables_are_made_once(device):
    """The PyTorch path's cos and sin tables are made once per device, length, head dim, base and dtype (every
    layer rotates q and k at the same positions), not while torch.compile traces, and rotate's result is the
    same from kept tables."""
    x = torch.randn(2, 2, 5, 32, device=device)
    reference._ROTARY_TABLES.clear()
    first = reference.rotate(x, LOCAL_THETA)
    tables = reference._rotary_tables(x.device, 5, 32, LOCAL_THETA, torch.float32)
    assert reference._rotary_tables(x.device, 5, 32, LOCAL_THETA, torch.float32) is tables
    assert torch.equal(reference.rotate(x, LOCAL_THETA), first)
    assert reference._rotary_tables(x.device, 5, 32, GLOBAL_THETA, torch.float32) is not tables  # another base
    kept = dict(reference._ROTARY_TABLES)
    torch.compile(lambda t: reference.rotate(t, 500.0), backend="eager", fullgraph=True)(x)
    assert reference._ROTARY_TABLES == kept  # what a trace makes is not kept


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_reference_and_kernel_are_transformers_modernbert(device, layer_type):
    """reference.attention with the layer's theta and window (config.sliding_window, |i - j| <= 64 on
    ModernBERT-base: here local_attention = 10, so |i - j| <= 5) equals transformers' math in fp32, and so does
    the kernel (ops on the Triton backend), on every token row (transformers leaves padded rows' values)."""
    torch.manual_seed(0)
    config = ModernBertConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=3, intermediate_size=64,
                              vocab_size=100, local_attention=10, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    config._attn_implementation = "eager"
    sliding = layer_type == "sliding_attention"
    theta = config.rope_parameters[layer_type]["rope_theta"]
    assert theta == (LOCAL_THETA if sliding else GLOBAL_THETA) and config.sliding_window == 5
    window = config.sliding_window if sliding else None
    batch, heads, seqlen, head_dim = 3, 2, 37, 64
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device=device) for _ in range(3))
    mask = torch.ones(batch, seqlen, dtype=torch.int64, device=device)
    mask[1, 30:] = 0
    mask[2, 1:] = 0
    expected = transformers_attention(q, k, v, mask, config, layer_type)
    tokens = mask.bool()[:, None, :, None].expand_as(expected)
    for backend in ("torch", "triton"):
        out = ops.attention(q, k, v, mask, backend=backend, rotary_base=theta, window=window)
        torch.testing.assert_close(out[tokens], expected[tokens], rtol=1e-5, atol=1e-5)
    # the window changes the result: a boundary of |i - j| < 5 or <= 6 would not match transformers
    for wrong in (4, 6):
        if sliding:
            out = reference.attention(q, k, v, mask, rotary_base=theta, window=wrong)
            assert (out[tokens] - expected[tokens]).abs().max() > 1e-3


@triton.jit
def _block_range_kernel(RANGES, lo, hi, window, BLOCK: tl.constexpr, INNER: tl.constexpr, WINDOW: tl.constexpr):
    pid = tl.program_id(0)
    start, end = attn._block_range(pid * BLOCK, BLOCK, lo, hi, window, INNER, WINDOW)
    tl.store(RANGES + 2 * pid, start)
    tl.store(RANGES + 2 * pid + 1, end)


def block_ranges(seqlen, lo, hi, window, block, inner, device):
    """[blocks, 2] (start, end) of the kernels' inner loops for each block of `block` positions."""
    blocks = triton.cdiv(seqlen, block)
    ranges = torch.empty(blocks, 2, dtype=torch.int32, device=device)
    _block_range_kernel[(blocks,)](ranges, lo, hi, 0 if window is None else window, BLOCK=block, INNER=inner,
                                   WINDOW=window is not None)
    return ranges.cpu()


@pytest.mark.parametrize("block,inner", [(128, 64), (64, 16), (128, 32)])
@pytest.mark.parametrize("lo,hi", [(0, 8192), (0, 5000), (37, 4000)])
def test_a_local_layer_visits_only_the_band(block, inner, lo, hi, device):
    """The block loops of the forward (queries x keys) and of both backward phases (_block_range) cover every
    position of [lo, hi) within the window of the block and no inner block outside it: at S = 8192 and
    ModernBERT's window of 64 a block visits at most (block + 2 w) / inner + 1 blocks, not S / inner."""
    seqlen, window = 8192, 64
    ranges = block_ranges(seqlen, lo, hi, window, block, inner, device)
    for index, (start, end) in enumerate(ranges.tolist()):
        first, last = index * block, min(index * block + block, seqlen)  # the block's positions [first, last)
        if last <= lo or first >= hi:
            assert start >= end, f"block {index} holds no token but visits [{start}, {end})"
            continue
        needed_first, needed_end = max(lo, first - window), min(hi, last + window)
        assert start % inner == 0 and start <= needed_first and end >= needed_end
        assert start > needed_first - inner and end == needed_end
        assert triton.cdiv(end - start, inner) <= (block + 2 * window) // inner + 1
    # without a window every live block visits all of [lo, hi)
    full = block_ranges(seqlen, lo, hi, None, block, inner, device)
    live = [index for index in range(full.shape[0]) if index * block < hi and index * block + block > lo]
    assert all(full[index].tolist() == [lo // inner * inner, hi] for index in live)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_equals_padded_bitwise(device, dtype):
    """The packed layout gives the padded call's results bitwise, with rotary positions, a window and dropout:
    positions (the angles, the band, the dropout counters) are offsets in the sequence in both."""
    torch.manual_seed(1)
    batch, heads, seqlen, head_dim = 4, 3, 97, 32
    *qkv, dout = make_inputs(batch, heads, seqlen, head_dim, dtype, device)
    lengths = make_lengths(batch, seqlen)
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).to(device)
    options = dict(dropout_p=0.1, rotary_base=LOCAL_THETA, window=5)

    def padded_fn(q, k, v):
        torch.manual_seed(2)
        return attn.attention(q, k, v, mask, **options)

    def packed_fn(q, k, v):
        packed = [reference.unpad(t.transpose(1, 2), mask)[0] for t in (q, k, v)]
        _, indices, cu_seqlens, _ = reference.unpad(q.transpose(1, 2), mask)
        torch.manual_seed(2)
        out = attn.attention_varlen(*packed, cu_seqlens, seqlen, **options)
        return reference.pad(out, indices, batch, seqlen).transpose(1, 2)

    padded_out, padded_grads = run(padded_fn, qkv, dout)
    packed_out, packed_grads = run(packed_fn, qkv, dout)
    assert torch.equal(padded_out, packed_out)
    for a, b in zip(padded_grads, packed_grads):
        assert torch.equal(a, b)


def dropout_band_reference(q, k, v, mask, keep, dropout_p, rotary_base, window):
    """softmax(rotate(q) rotate(k)^T / sqrt(d) + key mask + band) * keep / (1 - p) v, padded rows zeroed."""
    q, k = reference.rotate(q, rotary_base), reference.rotate(k, rotary_base)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    positions = torch.arange(q.shape[2], device=q.device)
    outside = (positions[None, :] - positions[:, None]).abs() > window  # [S, S]
    # padded keys at the dtype's minimum, not -inf: a padded row whose band holds no token stays finite (it is
    # zeroed below), and every token row keeps itself
    scores = scores.masked_fill(mask[:, None, None, :] == 0, torch.finfo(q.dtype).min)
    probs = torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1) * keep / (1.0 - dropout_p)
    return (probs @ v) * mask[:, None, :, None]


def test_dropout_with_a_window_uses_one_mask_forward_and_backward(device):
    """The mask recovered from the full attention (q = k = 0) is the window's too (same Philox counters), and
    the forward and the backward both apply it: S = 129 spans several blocks of all three kernels."""
    batch, heads, seqlen, head_dim, p = 2, 2, 129, 64, 0.2
    keep = recover_dropout_keep(batch, heads, seqlen, head_dim, p, seed=3, device=device)
    torch.manual_seed(4)
    *qkv, dout = make_inputs(batch, heads, seqlen, head_dim, torch.float32, device)
    mask = torch.ones(batch, seqlen, dtype=torch.int64, device=device)
    mask[1, 100:] = 0

    def kernel_fn(q, k, v):
        torch.manual_seed(3)
        return attn.attention(q, k, v, mask, dropout_p=p, rotary_base=LOCAL_THETA, window=5)

    assert_matches_reference(kernel_fn,
                             lambda q, k, v: dropout_band_reference(q, k, v, mask, keep, p, LOCAL_THETA, 5),
                             qkv, dout)


def test_backward_is_deterministic(device):
    torch.manual_seed(0)
    *qkv, dout = make_inputs(3, 2, 113, 32, torch.float16, device)
    mask = (torch.arange(113)[None, :] < make_lengths(3, 113)[:, None]).to(device)

    def fn(q, k, v):
        torch.manual_seed(7)
        return attn.attention(q, k, v, mask, dropout_p=0.1, rotary_base=GLOBAL_THETA, window=1)

    first, second = run(fn, qkv, dout), run(fn, qkv, dout)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


def test_torch_compile_traces_the_new_arguments(device):
    """rotary_base and window reach the custom ops' schemas (an int theta too) and their fake implementations."""
    torch.manual_seed(0)
    packed = [torch.randn(19, 2, 32, device=device, requires_grad=True) for _ in range(3)]
    cu_seqlens = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)

    def fn(q, k, v):
        return attn.attention_varlen(q, k, v, cu_seqlens, 12, rotary_base=10_000, window=3)

    out, grads = run(torch.compile(fn, backend="aot_eager", fullgraph=True), packed, torch.ones_like(packed[0]))
    eager_out, eager_grads = run(fn, packed, torch.ones_like(packed[0]))
    assert torch.equal(out, eager_out)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


def test_argument_errors(device):
    q = torch.randn(1, 2, 8, 32, device=device)
    bias = torch.zeros(8, 2, device=device)
    buckets = ops.relative_position_buckets(8, 16, device=device)
    with pytest.raises(ValueError, match=r"relative_bias with rotary_base=10000.0: .* does not combine"):
        attn.attention(q, q, q, relative_bias=bias, relative_buckets=buckets, rotary_base=10_000.0)
    with pytest.raises(ValueError, match=r"relative_bias with window=4: .* does not combine"):
        attn.attention(q, q, q, relative_bias=bias, relative_buckets=buckets, window=4)
    with pytest.raises(ValueError, match=r"window must be an int >= 0 .* got -1"):
        attn.attention(q, q, q, window=-1)
    with pytest.raises(ValueError, match=r"rotary_base must be a finite number > 0 .* got inf"):
        attn.attention(q, q, q, rotary_base=float("inf"))
    with pytest.raises(ValueError, match=r"rotary_base must be a finite number > 0 .* got 0.0"):
        attn.attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1),
                              torch.tensor([0, 8], dtype=torch.int32, device=device), 8, rotary_base=0.0)
