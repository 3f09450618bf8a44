"""kernels/attention.py against the float64 reference (fastbert.reference.attention) with DESIGN.md's
tolerance rule, on CPU under TRITON_INTERPRET=1 (fp32, fp16, bf16; long sequences on a GPU): padded batches
with a fully padded sequence and arbitrary masks, packed (varlen) batches, dropout, determinism,
torch.compile tracing and input errors."""
import contextlib

import pytest
import torch
import triton
from torch.profiler import ProfilerActivity, profile

from fastbert import reference
from fastbert.kernels import attention as attn
from fastbert.kernels.fused_op import always_custom_op
from fastbert.kernels.numerics import INTERPRETER
from tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, assert_within_rule


def make_qkv(batch, heads, seqlen, head_dim, dtype, device, layout):
    """q, k, v [B, heads, S, d]: contiguous, or views of one [B, S, 3, heads, d] buffer (the layout of a
    fused QKV projection: non-contiguous, interleaved). Each is a differentiable non-leaf view."""
    if layout == "qkv_buffer":
        buffer = torch.randn(batch, seqlen, 3, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        return buffer.permute(2, 0, 3, 1, 4).unbind(0)
    leaves = [torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype, requires_grad=True)
              for _ in range(3)]
    return [t * 1 for t in leaves]


def make_mask(batch, seqlen, kind, device):
    """[B, S] int64 mask, 1 = token. Sequence 1 is fully padded; the others have random lengths in
    [1, S], right padded ("right") or with their tokens at random positions ("arbitrary")."""
    if kind == "none":
        return None
    lengths = torch.randint(1, seqlen + 1, (batch,))
    lengths[1] = 0
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    if kind == "arbitrary":
        mask = torch.stack([row[torch.randperm(seqlen)] for row in mask])
    return mask.to(device)


def run(fn, inputs, dout):
    """fn(*inputs) and the gradients of <fn(*inputs), dout> w.r.t. inputs."""
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, dout)
    return out, grads


def assert_matches_reference(kernel_fn, reference_fn, q, k, v, dout):
    """kernel_fn(q, k, v) and its gradients within the rule of reference_fn in float64 (exact) and in
    q's dtype (PyTorch's own error). Returns the kernel's (out, (dq, dk, dv))."""
    out, grads = run(kernel_fn, (q, k, v), dout)
    exact_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_out, exact_grads = run(reference_fn, exact_inputs, dout.double())
    torch_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_out, torch_grads = run(reference_fn, torch_inputs, dout)
    assert_within_rule("out", out, torch_out, exact_out, FORWARD_FACTOR)
    for name, grad, torch_grad, exact_grad in zip(("dq", "dk", "dv"), grads, torch_grads, exact_grads):
        assert_within_rule(name, grad, torch_grad, exact_grad, GRADIENT_FACTOR)
    return out, grads


# Every listed length, the three dtypes, head dims 32/64/128, heads 2-4, both layouts and all mask kinds
# appear; not their full product (the interpreter is slow).
CASES = [
    # (S, dtype, head_dim, heads, layout, mask kind, scale)
    (1, torch.float32, 32, 2, "qkv_buffer", "right", None),
    (17, torch.float16, 64, 3, "contiguous", "arbitrary", 0.3),
    (33, torch.float16, 128, 2, "qkv_buffer", "right", None),
    (97, torch.float32, 64, 4, "qkv_buffer", "right", None),
    (113, torch.float16, 32, 2, "qkv_buffer", "arbitrary", None),
    (128, torch.float32, 32, 3, "contiguous", "none", None),
    (129, torch.float16, 64, 2, "qkv_buffer", "right", None),
    (257, torch.float32, 32, 2, "qkv_buffer", "arbitrary", None),
    (257, torch.float16, 64, 2, "contiguous", "right", None),
    (1, torch.bfloat16, 64, 2, "contiguous", "right", None),
    (37, torch.bfloat16, 32, 2, "qkv_buffer", "none", 0.5),
    (97, torch.bfloat16, 64, 3, "qkv_buffer", "right", None),
    (129, torch.bfloat16, 128, 2, "contiguous", "arbitrary", None),
]


@pytest.mark.parametrize("seqlen,dtype,head_dim,heads,layout,mask_kind,scale", CASES, ids=str)
def test_attention_matches_reference(device, seqlen, dtype, head_dim, heads, layout, mask_kind, scale):
    torch.manual_seed(seqlen)
    batch = 4
    q, k, v = make_qkv(batch, heads, seqlen, head_dim, dtype, device, layout)
    mask = make_mask(batch, seqlen, mask_kind, device)
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype)
    out, (dq, dk, dv) = assert_matches_reference(
        lambda q, k, v: attn.attention(q, k, v, mask, scale=scale),
        lambda q, k, v: reference.attention(q, k, v, mask, scale=scale), q, k, v, dout)
    if mask is not None:
        padded = (mask == 0)[:, None, :, None].expand_as(out)
        # padded rows (queries and keys) are exact zeros, with exact zero gradients
        for name, tensor in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert (tensor[padded] == 0).all(), f"{name} is nonzero on padded positions"


def test_head_dims_and_dtypes_errors(device):
    q = torch.randn(1, 2, 8, 48, device=device)
    with pytest.raises(ValueError, match="head dim .* 48"):
        attn.attention(q, q, q)
    q = torch.randn(1, 2, 8, 32, device=device, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        attn.attention(q, q, q)
    q = torch.randn(1, 2, 8, 32, device=device)
    with pytest.raises(ValueError, match="k has dtype torch.float16"):
        attn.attention(q, q.half(), q)
    with pytest.raises(ValueError, match="shape"):
        attn.attention(q, q[:, :, :4], q)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 7\)"):
        attn.attention(q, q, q, torch.ones(1, 7, device=device))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        attn.attention(q, q, q, dropout_p=1.0)
    packed = torch.randn(8, 2, 32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        attn.attention_varlen(packed, packed, packed, torch.tensor([0, 8], device=device), 8)
    with pytest.raises(ValueError, match="max_seqlen"):
        attn.attention_varlen(packed, packed, packed, torch.tensor([0, 8], device=device, dtype=torch.int32), 0)


def _broadcast_attention(varlen, seqlen, heads, requires_grad=False, trained_bias=False):
    """attention of q = k = v broadcast along the sequence (stride 0: they reach d elements), on meta tensors
    (nothing is allocated or launched); trained_bias: with a relative-position bias that requires grad."""
    head_dim = 64
    shape = (seqlen, heads, head_dim) if varlen else (1, heads, seqlen, head_dim)
    q = torch.zeros(1, device="meta", requires_grad=requires_grad).expand(shape)
    bias = {}
    if trained_bias:
        bias = dict(relative_bias=torch.zeros(8, heads, device="meta", requires_grad=True),
                    relative_buckets=torch.zeros(9, dtype=torch.int32, device="meta"))
    if varlen:
        return attn.attention_varlen(q, q, q, torch.tensor([0, seqlen], dtype=torch.int32, device="meta"), seqlen,
                                     **bias)
    return attn.attention(q, q, q, **bias)


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_output_offsets_past_int32_are_refused(varlen):
    """The output, laid out [.., S, heads, d], would span S * heads * d > 2**31 elements in one sequence:
    refused before anything is allocated."""
    with pytest.raises(ValueError, match=r"out: one sequence spans 2147483712 elements"):
        _broadcast_attention(varlen, 2**14, 2**11)


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_gradient_offsets_past_int32_are_refused_when_a_backward_may_run(varlen):
    """dq, dk and dv are the column blocks of one [.., S, 3, heads, d] buffer: 3 S heads d elements in one
    sequence, past 2**31 here while the output's S heads d fits. Refused in the forward when q, k, v or the
    relative bias need gradients; an inference call of the same size runs."""
    with pytest.raises(ValueError, match=r"dq, dk, dv: one sequence spans 3221225536 elements"):
        _broadcast_attention(varlen, 2**14, 2**10, requires_grad=True)
    with pytest.raises(ValueError, match=r"dq, dk, dv: one sequence spans 3221225536 elements"):
        _broadcast_attention(varlen, 2**14, 2**10, trained_bias=True)  # its gradient's backward writes them too
    out = _broadcast_attention(varlen, 2**14, 2**10)
    assert out.shape == ((2**14, 2**10, 64) if varlen else (1, 2**10, 2**14, 64))


def test_fully_padded_batch_gives_zeros_and_finite_grads(device):
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 2, 37, 32, torch.float16, device, "qkv_buffer")
    mask = torch.zeros(2, 37, dtype=torch.bool, device=device)
    out, grads = run(lambda q, k, v: attn.attention(q, k, v, mask, dropout_p=0.1), (q, k, v), torch.randn_like(q))
    assert (out == 0).all()
    for grad in grads:
        assert (grad == 0).all()


def recover_dropout_keep(batch, heads, seqlen, head_dim, dropout_p, seed, device):
    """The kernel's keep-mask [B, heads, S, S] for torch.manual_seed(seed): with q = k = 0 every kept
    probability is 1/S, and v = one-hot rows for a chunk of head_dim keys reads that chunk's columns."""
    zeros = torch.zeros(batch, heads, seqlen, head_dim, device=device)
    keep = torch.empty(batch, heads, seqlen, seqlen, dtype=torch.bool, device=device)
    for start in range(0, seqlen, head_dim):
        width = min(head_dim, seqlen - start)
        v = zeros.clone()
        v[:, :, start:start + width, :width] = torch.eye(width, device=device)
        torch.manual_seed(seed)
        out = attn.attention(zeros, zeros, v, dropout_p=dropout_p)
        chunk = out[..., :width]
        # kept entries are exactly 1 / (S (1 - p)); dropped ones exactly 0
        kept_value = torch.tensor(1.0 / seqlen / (1.0 - dropout_p), device=device)
        assert torch.isclose(chunk[chunk != 0], kept_value, rtol=1e-6).all()
        keep[..., start:start + width] = chunk != 0
    return keep


def test_dropout_rate_and_seed(device):
    p = 0.1
    keep = recover_dropout_keep(7, 4, 64, 64, p, seed=1, device=device)
    assert keep.numel() >= 100_000
    assert abs((1.0 - keep.float().mean().item()) - p) < 0.01
    # the mask depends on the head and the sequence, not only on (row, col)
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert torch.equal(keep, recover_dropout_keep(7, 4, 64, 64, p, seed=1, device=device))
    assert not torch.equal(keep, recover_dropout_keep(7, 4, 64, 64, p, seed=2, device=device))
    # eval mode and p = 0 draw no mask
    q = torch.randn(2, 2, 16, 32, device=device)
    assert torch.equal(attn.attention(q, q, q, dropout_p=p, training=False), attn.attention(q, q, q))


def test_each_philox_output_decides_its_own_key(device):
    """One Philox call decides four consecutive keys of a query row (kernels/attention.py _dropout_keep): each of
    its outputs keeps its key at the rate, and the four decisions are independent (all four equal for p^4 +
    (1 - p)^4 of the groups: 1/8 at p = 1/2, where one output copied to four keys would make it 1)."""
    keep = recover_dropout_keep(4, 4, 128, 64, 0.5, seed=5, device=device)
    for position in range(4):
        assert abs(keep[..., position::4].float().mean().item() - 0.5) < 0.02, position
    groups = keep.reshape(*keep.shape[:-1], 32, 4)
    all_equal = (groups.all(dim=-1) | ~groups.any(dim=-1)).float().mean().item()
    assert abs(all_equal - 0.125) < 0.02, all_equal


def dropout_reference(q, k, v, mask, keep, dropout_p):
    """softmax(q k^T / sqrt(d) + key mask) * keep / (1 - p) v, padded query rows zeroed."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(mask[:, None, None, :] == 0, torch.finfo(q.dtype).min)
    probs = torch.softmax(scores, dim=-1) * keep / (1.0 - dropout_p)
    return (probs @ v) * mask[:, None, :, None]


def test_dropout_forward_and_backward_use_the_recovered_mask(device):
    # S = 129 spans several query and key blocks in all three kernels (forward, dk/dv, dq)
    batch, heads, seqlen, head_dim, p = 2, 2, 129, 64, 0.2
    keep = recover_dropout_keep(batch, heads, seqlen, head_dim, p, seed=3, device=device)
    torch.manual_seed(4)
    q, k, v = make_qkv(batch, heads, seqlen, head_dim, torch.float32, device, "qkv_buffer")
    mask = make_mask(batch, seqlen, "right", device)
    mask[1] = 1  # (make_mask pads sequence 1 fully; here both hold tokens)
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device)

    def kernel_fn(q, k, v):
        torch.manual_seed(3)
        return attn.attention(q, k, v, mask, dropout_p=p)

    assert_matches_reference(kernel_fn, lambda q, k, v: dropout_reference(q, k, v, mask, keep, p), q, k, v, dout)


def test_backward_is_deterministic(device):
    torch.manual_seed(0)
    q, k, v = make_qkv(3, 2, 113, 32, torch.float16, device, "qkv_buffer")
    mask = make_mask(3, 113, "arbitrary", device)
    dout = torch.randn(3, 2, 113, 32, device=device, dtype=torch.float16)

    def fn(q, k, v):
        torch.manual_seed(7)
        return attn.attention(q, k, v, mask, dropout_p=0.1)

    first, second = run(fn, (q, k, v), dout), run(fn, (q, k, v), dout)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_varlen_equals_padded(device, dropout_p, dtype):
    """The packed layout (a constexpr variant of the same kernels) gives the padded call's results bitwise,
    in both 16-bit dtypes: the padded call is checked against the float64 reference above."""
    torch.manual_seed(1)
    batch, heads, seqlen, head_dim = 4, 3, 97, 32
    q, k, v = make_qkv(batch, heads, seqlen, head_dim, dtype, device, "contiguous")
    mask = make_mask(batch, seqlen, "right", device)  # sequence 1 empty: a zero-length packed sequence
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype)

    def padded_fn(q, k, v):
        torch.manual_seed(2)
        return attn.attention(q, k, v, mask, dropout_p=dropout_p)

    def packed_fn(q, k, v):
        # [B, heads, S, d] -> [T, heads, d] and back, around the varlen kernel
        packed = [reference.unpad(t.transpose(1, 2), mask)[0] for t in (q, k, v)]
        _, indices, cu_seqlens, _ = reference.unpad(q.transpose(1, 2), mask)
        torch.manual_seed(2)
        # max_seqlen = S (an upper bound is allowed) keeps the padded call's autotuning key on a GPU
        out = attn.attention_varlen(*packed, cu_seqlens, seqlen, dropout_p=dropout_p)
        return reference.pad(out, indices, batch, seqlen).transpose(1, 2)

    padded_out, padded_grads = run(padded_fn, (q, k, v), dout)
    packed_out, packed_grads = run(packed_fn, (q, k, v), dout)
    assert torch.equal(padded_out, packed_out)
    for a, b in zip(padded_grads, packed_grads):
        assert torch.equal(a, b)


def test_a_strided_cu_seqlens_is_read_by_its_strides(device):
    """cu_seqlens as a strided view (every other element of a buffer) gives the contiguous one's results, forward
    and backward: the kernels read it at offset b, so a view was read past its elements (wrong rows, or on other
    values an out-of-bounds read)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(10, 2, 32, device=device, requires_grad=True) for _ in range(3))
    contiguous = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    strided = torch.tensor([0, 99, 3, 99, 10, 99], dtype=torch.int32, device=device)[::2]
    assert strided.stride() == (2,) and torch.equal(strided, contiguous)
    dout = torch.randn(10, 2, 32, device=device)
    results = [run(lambda q, k, v, cu=cu: attn.attention_varlen(q, k, v, cu, 7), (q, k, v), dout)
               for cu in (contiguous, strided)]
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_torch_compile_traces_without_graph_breaks(device):
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 2, 19, 32, torch.float32, device, "qkv_buffer")
    mask = make_mask(2, 19, "right", device)

    def padded(q, k, v, mask):
        return attn.attention(q, k, v, mask, dropout_p=0.1)

    torch.manual_seed(5)
    eager = padded(q, k, v, mask)
    torch.manual_seed(5)
    compiled = torch.compile(padded, backend="eager", fullgraph=True)(q, k, v, mask)
    assert torch.equal(eager, compiled)
    compiled.sum().backward()
    traced = []

    def recording(graph, example_inputs):
        traced.append(graph.code)
        return graph.forward

    with torch.no_grad():  # the inference op (no log-sum-exp) traces too, in its place
        torch.manual_seed(5)
        inferred = torch.compile(padded, backend=recording, fullgraph=True)(q, k, v, mask)
    assert torch.equal(inferred, eager.detach())
    assert "fastbert.attention_infer" in traced[-1] and "attention_fwd" not in traced[-1]

    # aot_eager also traces the backward through the registered fake and autograd implementations
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    cu_seqlens = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    varlen = torch.compile(lambda q, k, v: attn.attention_varlen(q, k, v, cu_seqlens, 12),
                           backend="aot_eager", fullgraph=True)
    out, grads = run(varlen, packed, torch.ones_like(packed[0]))
    eager_out, eager_grads = run(lambda q, k, v: attn.attention_varlen(q, k, v, cu_seqlens, 12), packed,
                                 torch.ones_like(packed[0]))
    assert torch.equal(out, eager_out)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


def _forward_work(fn, monkeypatch) -> tuple[int, dict, object]:
    """(the tensors fn allocates: aten::empty and aten::empty_strided calls, which the profiler records in the
    eager call as in the custom op; the forward kernel's constexprs; its LSE argument) with the launch recorded,
    not run: Triton's interpreter allocates tensors of its own."""
    launches = []
    with monkeypatch.context() as patch:
        patch.setattr(attn, "launch", lambda kernel, grid, *args, **constexprs: launches.append((args, constexprs)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    allocations = sum(event.count for event in prof.key_averages()
                      if event.key in ("aten::empty", "aten::empty_strided"))
    ((args, constexprs),) = launches
    return allocations, constexprs, args[4]


@pytest.mark.parametrize("entrance", ["eager", "custom op"])
@pytest.mark.parametrize("no_grad", [True, False], ids=["no_grad", "frozen inputs"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_inference_stores_no_log_sum_exp(entrance, no_grad, layout, device, monkeypatch):
    """Where no backward can follow (grad mode off, or no input needing a gradient) the forward allocates its
    output alone, not the fp32 log-sum-exp a backward reads (its kernel stores none, given an empty fp32
    placeholder, so that the autotuner's key stays the training forward's), and its output is bitwise the training
    forward's, through the eager call and the custom op."""
    torch.manual_seed(0)
    q, k, v = (t.detach() for t in make_qkv(2, 2, 19, 32, torch.float32, device, "contiguous"))
    mask = torch.ones(2, 19, dtype=torch.int64, device=device)
    mask[1, 11:] = 0
    cu_seqlens = torch.tensor([0, 19, 30], dtype=torch.int32, device=device)
    packed = [torch.cat((t[0].transpose(0, 1), t[1, :, :11].transpose(0, 1))) for t in (q, k, v)]
    entered = contextlib.nullcontext if entrance == "eager" else always_custom_op
    context = torch.no_grad if no_grad else contextlib.nullcontext

    def forward(trainable):
        inputs = [t.requires_grad_(trainable) for t in (packed if layout == "packed" else (q, k, v))]
        with entered(), (contextlib.nullcontext() if trainable else context()):
            if layout == "packed":
                return attn.attention_varlen(*inputs, cu_seqlens, 19)
            return attn.attention(*inputs, mask)

    trained, inferred = forward(True), forward(False)  # the mask's derived tensors are made once, then kept
    training_allocations, training_flags, training_lse = _forward_work(lambda: forward(True), monkeypatch)
    allocations, flags, lse = _forward_work(lambda: forward(False), monkeypatch)
    assert (training_allocations, training_flags["STORE_LSE"], training_lse.shape) == (
        2, True, (2, 30) if layout == "packed" else (2, 2, 19))
    assert (allocations, flags["STORE_LSE"], lse.numel(), lse.dtype) == (1, False, 0, torch.float32)
    assert trained.requires_grad and not inferred.requires_grad
    assert torch.equal(inferred, trained.detach())


@pytest.mark.parametrize("entrance", ["eager", "custom op"])
def test_inference_op_refuses_a_backward(entrance, device):
    """Called directly on inputs that require grad (attention and attention_varlen never do), the inference op's
    output raises at backward, naming the ops to use, through either entrance."""
    q, k, v = make_qkv(1, 2, 8, 32, torch.float32, device, "contiguous")
    with contextlib.nullcontext() if entrance == "eager" else always_custom_op():
        out = attn.attention_infer(q, k, v, None, None, 8, None, 0.0, 32 ** -0.5)
    with pytest.raises(RuntimeError, match="attention_infer keeps no log-sum-exp.*call attention_fwd, or attention / "):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen,head_dim,mask_kind", [(512, 64, "arbitrary"), (1000, 128, "right"),
                                                       (4096, 32, "right")])
def test_attention_bf16_long_sequences(device, seqlen, head_dim, mask_kind):
    """BERT's longest sequences and beyond (slow in the interpreter)."""
    torch.manual_seed(seqlen)
    batch, heads = 4, 3
    q, k, v = make_qkv(batch, heads, seqlen, head_dim, torch.bfloat16, device, "qkv_buffer")
    mask = make_mask(batch, seqlen, mask_kind, device)
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=torch.bfloat16)
    assert_matches_reference(lambda q, k, v: attn.attention(q, k, v, mask),
                             lambda q, k, v: reference.attention(q, k, v, mask), q, k, v, dout)


def test_padded_and_packed_calls_share_an_autotune_key(device, monkeypatch):
    """On a GPU the autotuner picks blocks per key, and "varlen equals padded, bitwise" needs both layouts
    to run the same blocks: the key depends on what changes the compiled kernel (dtype, head dim, dropout,
    precision) and the length bucket, never on the dtypes of placeholder pointers. The interpreter has one
    config, which skips the autotuner's key: with two candidates and a stand-in benchmark, a padded call
    with a mask, one without and the packed call at the same shapes fill one cache entry per kernel. The two
    are candidates of the GPU's architecture (on a GPU the launchers' pruning keeps no other)."""
    architecture = 90 if INTERPRETER else attn._architecture()
    two_configs = {attn._attention_fwd_kernel: (("BLOCK_M", "BLOCK_N"), attn.FWD_SHAPES[architecture][-2:]),
                   attn._attention_bwd_kernel: (("BLOCK_MAJOR", "BLOCK_MINOR"), attn.BWD_SHAPES[architecture][-2:])}
    for kernel, (names, shapes) in two_configs.items():
        monkeypatch.setattr(kernel, "configs", [triton.Config(dict(zip(names, (m, n))), num_warps=w, num_stages=s)
                                                for m, n, w, s in shapes])
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.delitem(kernel.__dict__, "do_bench", raising=False)  # a cached benchmarker
        monkeypatch.setattr(kernel, "_do_bench", lambda call, quantiles: [1.0, 1.0, 1.0])
    torch.manual_seed(0)
    batch, heads, seqlen, head_dim = 3, 2, 37, 32
    q, k, v = make_qkv(batch, heads, seqlen, head_dim, torch.float32, device, "contiguous")
    mask = make_mask(batch, seqlen, "right", device)
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device)
    run(lambda q, k, v: attn.attention(q, k, v, mask), (q, k, v), dout)
    run(lambda q, k, v: attn.attention(q, k, v), (q, k, v), dout)
    _, _, cu_seqlens, _ = reference.unpad(q.transpose(1, 2), mask)
    packed = [reference.unpad(t.transpose(1, 2), mask)[0] for t in (q, k, v)]
    run(lambda q, k, v: attn.attention_varlen(q, k, v, cu_seqlens, seqlen), packed, torch.randn_like(packed[0]))
    with torch.no_grad():  # the inference forward, which stores no log-sum-exp, runs the same blocks
        attn.attention(q, k, v, mask)
    for kernel in two_configs:
        assert len(kernel.cache) == 1, list(kernel.cache)
        key = next(iter(kernel.cache))
        assert {triton.next_power_of_2(seqlen), head_dim, "ieee", "torch.float32"} <= set(key), key


def test_the_mask_bounds_are_kept_per_mask_and_version(device):
    """Every layer passes its forward's one mask: its bounds are computed once, anew after an in-place change,
    and every time for an inference-mode mask (no version to tell a refilled static buffer)."""
    from fastbert.kernels import attention as kernel
    from fastbert.kernels.launch import placeholders

    q = torch.zeros(2, 1, 4, 32, device=device)
    unread = placeholders(q.device)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], device=device)
    first = kernel._mask_and_bounds(q, mask, unread)
    assert kernel._mask_and_bounds(q, mask, unread) is first
    assert first[2].tolist() == [2, 4]  # each sequence's last token + 1
    mask[1, 3] = 0
    assert kernel._mask_and_bounds(q, mask, unread)[2].tolist() == [2, 3]
    with torch.inference_mode():
        static = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], device=device)
        assert kernel._mask_and_bounds(q, static, unread)[2].tolist() == [1, 2]
        static.copy_(torch.ones_like(static))
        assert kernel._mask_and_bounds(q, static, unread)[2].tolist() == [4, 4]
