"""Pure-PyTorch reference of every fused op: the eager baseline, the CPU path, and the oracle the
Triton kernels are tested against. Same signatures and semantics as `fastbert.ops`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastbert.kernels.fused_op import backward_follows, c_apply, once_differentiable, tracing
from fastbert.last_mask import LastMask, may_keep


def layer_norm(x, weight, bias, eps=1e-12, residual=None, dropout_p=0.0, training=True, return_residual=False):
    """LayerNorm(dropout(x) + residual) over the last dim. x, residual [..., H]; weight [H]; bias [H] or None.
    return_residual: (LayerNorm(summed), summed) with summed = dropout(x) + residual, the pre-LN stream."""
    h = F.dropout(x, dropout_p, training) if dropout_p > 0 else x
    if residual is not None:
        h = h + residual
    normed = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return (normed, h) if return_residual else normed


def dropout(x, p, training=True):
    """F.dropout: elements zeroed with probability p, the rest scaled by 1 / (1 - p); stores its mask."""
    return F.dropout(x, p, training)


def bias_gelu(x, bias, approximate="none"):
    """gelu(x + bias). x [..., N]; bias [N]; approximate "none" (erf) or "tanh"."""
    return F.gelu(x + bias, approximate=approximate)


def linear_bias_gelu(x, weight, bias, approximate="none"):
    """gelu(x @ weight.T + bias): the FFN up-projection with its activation. weight [N, K]."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def feed_forward(x, w1, b1, w2, b2, approximate="none"):
    """gelu(x @ w1.T + b1) @ w2.T + b2: BERT's FFN. w1 [N, K], w2 [K2, N]; b1, b2 may be None."""
    return F.linear(linear_bias_gelu(x, w1, b1, approximate), w2, b2)


def feed_forward_geglu(x, w1, b1, w2, b2, approximate="none"):
    """(gelu(a) * b) @ w2.T + b2 with [a, b] = (x @ w1.T + b1).chunk(2): ModernBERT's GeGLU FFN (transformers'
    ModernBertMLP: Wi, chunk, act(input) * gate, Wo). w1 [2I, K], w2 [K2, I]; b1, b2 may be None."""
    a, b = F.linear(x, w1, b1).chunk(2, dim=-1)
    return F.linear(F.gelu(a, approximate=approximate) * b, w2, b2)


def qkv_projection(x, weight, bias, num_heads):
    """One matmul for query, key and value.

    x [B, S, H] -> q, k, v each [B, heads, S, d]; x [T, H] (packed tokens) -> each [T, heads, d].
    weight [3H, H] holds the query, key and value rows in that order (HF's three Linear layers
    concatenated); bias [3H] or None.
    """
    hidden = x.shape[-1]
    head_dim = hidden // num_heads
    qkv = F.linear(x, weight, bias)  # [..., 3H]
    if x.dim() == 2:
        return qkv.view(x.shape[0], 3, num_heads, head_dim).unbind(1)
    batch, seqlen = x.shape[:2]
    # unbound along the 3 of [B, S, 3, heads, d], each then [B, heads, S, d]: the backward stacks the three
    # gradients into that layout, which is qkv's [B, S, 3H] as it is. Unbound after a permute to [3, B, heads,
    # S, d] (the same views), it stacked them in the permuted layout and copied that back: a second copy of
    # [B, S, 3H] a layer, on the GPU path too (fastbert.paths chooses this form for the QKV projection on an H100)
    heads = qkv.view(batch, seqlen, 3, num_heads, head_dim)
    if not torch.is_grad_enabled():  # no backward to stack for: the same three views from one permute, two view
        return heads.permute(2, 0, 3, 1, 4).unbind(0)  # ops fewer (each a few microseconds of host time)
    q, k, v = heads.unbind(2)  # each [B, S, heads, d]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


# what the last key mask gives, kept (fastbert.last_mask: every layer takes its forward's one mask): the additive
# score bias per dtype, with a sliding window's band per dtype and window, the query multiplier per dtype, and for
# packed sequences the padded layout's mask and rows
_MASK_BIAS, _MASK_AND_BAND, _QUERY_KEEP, _PACKED_LAYOUT = LastMask(), LastMask(), LastMask(), LastMask()


def _key_mask_bias(attention_mask, dtype):
    """[B, S] 1/0 mask -> additive [B, 1, 1, S] bias. A finite large negative (not -inf) keeps fully
    padded rows finite; those rows are zeroed afterwards by _zero_padded_queries."""
    def make():
        keep = attention_mask.to(torch.bool)
        bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        return bias.masked_fill(~keep, torch.finfo(dtype).min)[:, None, None, :]
    return _MASK_BIAS.get(attention_mask, dtype, make)


def _zero_padded_queries(out, attention_mask):
    """out [B, heads, S, d]: rows of padded query positions become zeros (any nonzero mask value is a token, as in
    transformers' masks and the kernels: a mask of 2s keeps a row, it does not double it). The key mask
    [B, P + S] of prefix keys masks the queries by its last S columns."""
    prefix = attention_mask.shape[1] - out.shape[2]
    return out * _QUERY_KEEP.get(attention_mask, (out.dtype, prefix),
                                 lambda: attention_mask[:, prefix:].to(torch.bool).to(out.dtype)[:, None, :, None])


def relative_position_buckets(num_buckets: int = 32, max_distance: int = 128, device=None) -> torch.Tensor:
    """int32 [2 * max_distance + 1]: entry [d + max_distance] is the bucket of key-minus-query distance d,
    by T5's bidirectional bucketing as transformers' MPNet computes it (MPNetEncoder.relative_position_bucket):
    the lower half of the buckets for keys at or before the query, the upper half for keys after it; in each
    half, distances below num_buckets // 4 get a bucket each, longer ones logarithmically wider buckets up to
    max_distance. Every |d| >= max_distance falls in the bucket of +-max_distance, so any distance is looked
    up as buckets[clamp(d, -max_distance, max_distance) + max_distance].

    Computed on `device` with transformers' arithmetic, in its order and precisions (an fp32 log divided by
    a float64 constant, truncated), so the buckets at the log buckets' boundaries are transformers' own on
    that device. Raises ValueError unless num_buckets >= 4 and max_distance > num_buckets // 4.
    """
    half = num_buckets // 2
    max_exact = half // 2
    if num_buckets < 4:
        raise ValueError(f"num_buckets is {num_buckets}; T5's bidirectional bucketing needs at least 4")
    if max_distance <= max_exact:
        raise ValueError(f"max_distance is {max_distance}; it must exceed num_buckets // 4 = {max_exact}, "
                         f"the distances that get a bucket each")
    distance = torch.arange(-max_distance, max_distance + 1, device=device)  # key - query
    after = distance > 0
    n = distance.abs()
    # the log's argument is clamped to max_exact where the exact bucket is taken instead, so no log(0)
    log_ratio = torch.log(n.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    log_bucket = (max_exact + (log_ratio * (half - max_exact)).long()).clamp(max=half - 1)
    bucket = torch.where(n < max_exact, n, log_bucket) + after.long() * half
    return bucket.to(torch.int32)


def _relative_position_bias(relative_bias, relative_buckets, seqlen, dtype):
    """[heads, S, S] in `dtype`: entry [h, i, j] = relative_bias[bucket of j - i, h]. relative_bias
    [num_buckets, heads]; relative_buckets int32 [2D + 1] from relative_position_buckets."""
    max_distance = (relative_buckets.numel() - 1) // 2
    positions = torch.arange(seqlen, device=relative_buckets.device)
    distance = (positions[None, :] - positions[:, None]).clamp(-max_distance, max_distance)  # [S, S]
    buckets = relative_buckets[distance + max_distance].long()  # [S, S]
    return relative_bias.to(dtype)[buckets].permute(2, 0, 1)


def rotate(x, base: float):
    """x [B, heads, S, d] rotated by RoPE at positions 0..S-1 (rotate_half layout: dimension i pairs with
    i + d/2, as transformers' apply_rotary_pos_emb), at angles position * base ** (-2i / d); computed in fp32
    (float64 for float64 x) and returned in x's dtype. rotate_half(x) * sin is x's halves swapped (a roll by d/2)
    times the sine with its first half negated: the same products, in 2 autograd nodes rather than 5."""
    d = x.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, signed_sin = _rotary_tables(x.device, x.shape[-2], d, base, work)
    xw = x.to(work)
    return (xw * cos + xw.roll(d // 2, dims=-1) * signed_sin).to(x.dtype)


# (device, positions, head dim, base, dtype) -> rotate's (cos, sin), made once: every layer of a rotary model rotates
# q and k at the same positions, and took 12 torch ops a call to make them. A few entries (ModernBERT's global and
# local layers have their own bases; packed batches bring their own lengths), each [S, d]
_ROTARY_TABLES: dict = {}
ROTARY_TABLES_KEPT = 8


def _rotary_tables(device, seqlen: int, d: int, base: float, work: torch.dtype):
    """(cos, signed sin) [seqlen, d] in `work` at angles position * base ** (-2i / d), i < d/2, over both halves
    (the sine negated over the first)."""
    key = (device, seqlen, d, base, work)
    keep = may_keep(device)
    found = _ROTARY_TABLES.get(key) if keep else None
    if found is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).to(work) / d))
        angles = torch.arange(seqlen, device=device, dtype=work)[:, None] * inv_freq[None]  # [S, d/2]
        cos, sin = angles.cos(), angles.sin()
        found = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        if keep:
            if len(_ROTARY_TABLES) >= ROTARY_TABLES_KEPT:
                _ROTARY_TABLES.clear()
            _ROTARY_TABLES[key] = found
    return found


def _score_bias(q, attention_mask, relative_bias, relative_buckets, window=None):
    """What is added to q k^T * scale: the key mask's bias [B, 1, 1, S], the relative-position bias
    [heads, S, S] and the sliding window's band (-inf where |i - j| > window) (any may be absent: None when
    all are)."""
    if window is not None and relative_bias is None and attention_mask is not None:
        # the mask's terms alone (ModernBERT's local layers), kept per mask: [B, 1, S, S], as each layer made
        return _MASK_AND_BAND.get(attention_mask, (q.dtype, window),
                                  lambda: _key_mask_bias(attention_mask, q.dtype) + _band(q, window))
    bias = None if attention_mask is None else _key_mask_bias(attention_mask, q.dtype)
    if relative_bias is not None:
        position_bias = _relative_position_bias(relative_bias, relative_buckets, q.shape[2], q.dtype)
        bias = position_bias if bias is None else bias + position_bias
    if window is not None:
        band = _band(q, window)
        bias = band if bias is None else bias + band
    return bias


def _band(q, window: int) -> torch.Tensor:
    """[S, S] in q's dtype: 0 where |i - j| <= window, -inf elsewhere."""
    positions = torch.arange(q.shape[2], device=q.device)
    outside = (positions[None, :] - positions[:, None]).abs() > window  # [S, S]
    return torch.zeros(outside.shape, dtype=q.dtype, device=q.device).masked_fill(outside, float("-inf"))


def attention(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, training=True, relative_bias=None,
              relative_buckets=None, rotary_base=None, window=None):
    """softmax(rotate(q) rotate(k)^T * scale + key mask + relative-position bias + window band) v, bidirectional.

    q, k, v [B, heads, S, d]; attention_mask [B, S] with 1 = token, 0 = padding (bool or int). With P prefix keys
    (no position: no relative bias, rotation or window), k and v are [B, heads, P + S, d] and the mask [B, P + S].
    relative_bias [num_buckets, heads] (any float dtype, cast to q's) with relative_buckets int32 [2D + 1]
    (relative_position_buckets), or both None: MPNet's bias relative_bias[bucket(j - i), h] on score (i, j)
    of head h, materialised [heads, S, S]. rotary_base: q and k rotated by RoPE (`rotate`) at their row
    index; window: only keys with |i - j| <= window (ModernBERT's local layers).
    Padded query rows come out as zeros, so a fully padded sequence gives zeros, never NaN.
    """
    p = dropout_p if training else 0.0
    if rotary_base is not None:
        q, k = rotate(q, rotary_base), rotate(k, rotary_base)
    bias = _score_bias(q, attention_mask, relative_bias, relative_buckets, window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scale)
    return out if attention_mask is None else _zero_padded_queries(out, attention_mask)


def attention_with_probs(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, training=True, relative_bias=None,
                         relative_buckets=None, rotary_base=None, window=None):
    """`attention` that also returns the probabilities [B, heads, S, P + S] (before dropout), as
    transformers' output_attentions does. It materialises the S x S scores: for inspection, not speed."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if rotary_base is not None:
        q, k = rotate(q, rotary_base), rotate(k, rotary_base)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, heads, S, P + S]
    bias = _score_bias(q, attention_mask, relative_bias, relative_buckets, window)
    if bias is not None:
        scores = scores + bias
    probs = scores.softmax(dim=-1)
    out = F.dropout(probs, dropout_p, training) @ v if dropout_p > 0 else probs @ v
    if attention_mask is not None:
        out = _zero_padded_queries(out, attention_mask)
    return out, probs


def attention_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, scale=None, training=True, relative_bias=None,
                     relative_buckets=None, rotary_base=None, window=None):
    """Attention over packed sequences. q, k, v [T, heads, d]; cu_seqlens int32 [B+1]. The positions (the
    relative bias's, the rotary angles', the window's) are those inside each sequence. Rows in no sequence
    (past cu_seqlens[-1]) come out as zeros. Runs `attention` on the padded layout [B, heads, max_seqlen, d],
    built with sizes from the shapes (no host sync)."""
    batch = cu_seqlens.numel() - 1
    mask, positions = _PACKED_LAYOUT.get(cu_seqlens, (max_seqlen, q.shape[0]),
                                         lambda: _padded_layout(cu_seqlens, max_seqlen, q.shape[0]))

    def to_padded(t):  # [T, heads, d] -> [B, heads, S, d]
        return pad(t, positions, batch, max_seqlen).transpose(1, 2)

    out = attention(to_padded(q), to_padded(k), to_padded(v), mask, dropout_p, scale, training, relative_bias,
                    relative_buckets, rotary_base, window)
    out = F.pad(out.transpose(1, 2).flatten(0, 1), (0, 0, 0, 0, 0, 1))  # [B*S + 1, heads, d]: a zero row last
    return out.index_select(0, positions)  # [T, heads, d]


def _padded_layout(cu_seqlens, max_seqlen: int, rows: int):
    """(the key mask [B, max_seqlen] bool, packed_positions) of packed sequences."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    mask = torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]  # [B, S]
    return mask, packed_positions(cu_seqlens, rows, max_seqlen)


def packed_positions(cu_seqlens, rows: int, max_seqlen: int) -> torch.Tensor:
    """int64 [rows]: the position of each packed row in the padded layout [B, max_seqlen] flattened
    (sequence * max_seqlen + its offset in the sequence), with B = cu_seqlens.numel() - 1; B * max_seqlen, one
    past the end, for a row in no sequence (past cu_seqlens[-1]) or past max_seqlen in its own. Device ops on
    cu_seqlens and the shapes: no host sync."""
    batch = cu_seqlens.numel() - 1
    row = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens[1:], row, right=True)  # [rows] in [0, B]: B past the last
    offset = (row - cu_seqlens[sequence]).long()
    inside = (sequence < batch) & (offset < max_seqlen)
    return torch.where(inside, sequence * max_seqlen + offset, batch * max_seqlen)


def unpad(hidden, attention_mask):
    """Padded [B, S, ...] to packed rows, every size taken from the shapes (no host sync, static for
    torch.compile / torch.export). hidden [B, S, ...]; attention_mask [B, S] (1 = token, 0 = padding).

    Returns (packed [B*S, ...], indices int64 [B*S], cu_seqlens int32 [2B + 1], max_seqlen = S):
    - packed: the T real tokens first, sequence by sequence in order, then the B*S - T padding tokens, in order;
    - cu_seqlens: the B sequences (its first B + 1 entries, ending at T), then each sequence's padding as a
      sequence of its own (S - its length tokens, possibly none), so that every row belongs to a sequence of
      at most S tokens: the varlen attention writes every row, and padding never attends to a real token or
      the reverse, so the real rows' results are those of the exact packing;
    - indices: each row's position in the flattened B*S positions, B*S (past the end) for a padding row,
      which `pad` drops.
    The cost of static sizes: every op after this runs on B*S rows (no FLOP saved on padding; the attention
    runs over each sequence's padding too). Packed inputs built on the host (cu_seqlens, max_seqlen) give
    exact sizes instead.
    """
    batch, seqlen = attention_mask.shape
    keep = attention_mask.to(torch.bool)
    lengths = keep.sum(dim=1, dtype=torch.int32)  # [B]
    flat_keep = keep.flatten()
    # a stable sort on "is padding" puts the real tokens first, in their order, then the padding in its order
    order = torch.sort((~flat_keep).to(torch.uint8), stable=True).indices  # [B*S]
    cu_seqlens = F.pad(torch.cumsum(torch.cat([lengths, seqlen - lengths]), dim=0, dtype=torch.int32), (1, 0))
    indices = torch.where(flat_keep[order], order, batch * seqlen)
    return hidden.flatten(0, 1).index_select(0, order), indices, cu_seqlens, seqlen


def pad(packed, indices, batch, seqlen):
    """Inverse of `unpad`: packed rows [R, ...] scattered to their positions `indices` (int64 [R], into the
    flattened B*S) in zeros [B, S, ...]; rows whose index is B*S (unpad's padding rows) are dropped, and get
    no gradient."""
    out = packed.new_zeros((batch * seqlen + 1, *packed.shape[1:]))  # the last row takes the dropped rows
    out = out.index_copy(0, indices, packed)[:-1]  # out-of-place, so autograd flows to `packed`
    return out.view(batch, seqlen, *packed.shape[1:])


# Rows of logits materialised at once in eager mode: bounds the reference's memory at chunk x V floats (traced by
# torch.compile or torch.export, all the rows are one chunk, as the Triton kernel is what a GPU runs there).
CROSS_ENTROPY_CHUNK_ROWS = 1024


class _LinearCrossEntropy(torch.autograd.Function):
    """Cross entropy of x @ weight.T + bias, in row chunks, with the gradient computed chunk by chunk
    in the forward (the logits' gradient softmax - target is known there), so neither pass holds
    the [N, V] logits in eager mode (traced, one chunk of all the rows: CROSS_ENTROPY_CHUNK_ROWS). New-style (setup_context apart), as torch.func.grad needs: the forward, which then
    sees no ctx, is told whether to compute the gradients (needs_grad) and returns them, None where not. No jvp
    (Dynamo refuses a Function that has one): forward-mode AD gets PyTorch's error for a Function without."""

    @staticmethod
    def forward(x, weight, bias, target, ignore_index, reduction, label_smoothing, needs_grad):
        rows, vocab = x.shape[0], weight.shape[0]
        valid = target != ignore_index  # [N]
        count = valid.sum()
        # mean over labelled rows; a batch with no labelled row gives 0, not 0/0
        scale = 1.0 / count.clamp(min=1).to(torch.float32) if reduction == "mean" else torch.ones((), device=x.device)
        loss = torch.zeros((), dtype=torch.float64, device=x.device)  # as nll_loss on CPU: fp32 sums drift
        correct = torch.zeros((), dtype=torch.int64, device=x.device)
        grad_x = torch.zeros_like(x) if needs_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if needs_grad else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=x.device) if needs_grad and bias is not None else None
        # one chunk while torch.compile or torch.export traces: a loop over the rows would fix their number in the
        # graph (a recompile for each batch shape, an exported program that runs at the traced shape alone)
        step = CROSS_ENTROPY_CHUNK_ROWS
        chunks = [(0, rows)] if torch.compiler.is_compiling() else [(i, i + step) for i in range(0, rows, step)]
        for start, end in chunks:
            xs, ts, vs = x[start:end], target[start:end], valid[start:end]
            logits = F.linear(xs, weight, bias).float()  # [n, V]
            log_probs = torch.log_softmax(logits, dim=-1)
            safe_t = torch.where(vs, ts, 0).long()
            nll = -log_probs.gather(1, safe_t[:, None]).squeeze(1)  # [n]
            smooth = -log_probs.mean(dim=1)  # [n]
            row_loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
            loss += torch.where(vs, row_loss, 0.0).sum(dtype=torch.float64)
            correct += ((logits.argmax(dim=1) == ts) & vs).sum()
            if needs_grad:
                # d loss / d logits = softmax - ((1 - eps) onehot + eps / V), on labelled rows only
                grad_logits = log_probs.exp_()
                grad_logits.sub_(label_smoothing / vocab)
                grad_logits.scatter_add_(1, safe_t[:, None], torch.full_like(nll[:, None], label_smoothing - 1.0))
                grad_logits.mul_((vs.float() * scale)[:, None])
                grad_x[start:end] = (grad_logits.to(weight.dtype) @ weight).to(x.dtype)
                grad_w += grad_logits.t() @ xs.float()
                if grad_b is not None:
                    grad_b += grad_logits.sum(dim=0)
        return (loss * scale).float(), correct, grad_x, grad_w, grad_b

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs[:3]
        _, correct, *grads = output
        ctx.mark_non_differentiable(correct, *(g for g in grads if g is not None))
        if grads[0] is not None:
            # x, weight and bias too, unread: what the gradients depend on, for once_differentiable
            ctx.save_for_backward(*grads, x, weight, bias)
            ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, *_):  # the returned gradients are not differentiable
        grad_x, grad_w, grad_b = ctx.saved_tensors[:3]
        weight_dtype, bias_dtype = ctx.param_dtypes
        grad_x = grad_x * grad_loss.to(grad_x.dtype)
        grad_w = (grad_w * grad_loss).to(weight_dtype)
        grad_b = None if grad_b is None else (grad_b * grad_loss).to(bias_dtype)
        # the gradients were computed in the forward, outside any graph: a second derivative would miss x's part
        return once_differentiable("the reference linear_cross_entropy",
                                   (grad_x, grad_w, grad_b, None, None, None, None, None), ctx, (grad_loss,))


_LINEAR_CROSS_ENTROPY_APPLY = c_apply(_LinearCrossEntropy)


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Cross entropy of x @ weight.T + bias without holding the full logits.

    x [N, H]; weight [V, H]; bias [V] or None; target int [N]. Returns (loss fp32 scalar,
    num_correct int64 scalar: labelled rows whose argmax is the target). reduction "mean" divides
    by the number of labelled rows (0 labelled rows give loss 0 and zero gradients), "sum" does not.
    """
    needs_grad = backward_follows((x, weight, bias))
    # Function.apply's Python layer where PyTorch traces or transforms (torch.compile, torch.func), else autograd's own
    apply = _LinearCrossEntropy.apply if tracing() else _LINEAR_CROSS_ENTROPY_APPLY
    loss, correct, *_ = apply(x, weight, bias, target, ignore_index, reduction, label_smoothing, needs_grad)
    return loss, correct
