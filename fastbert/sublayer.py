# A sublayer as one autograd node in eager training: the attention sublayer LayerNorm(dropout(dense(attention(
# qkv(x)))) + x) and the feed-forward one LayerNorm(dropout(ffn(x)) + x) of the post-LayerNorm family, and
# ModernBERT's pre-LayerNorm attention sublayer, whose qkv reads attn_norm(x) and whose LayerNorm (mlp_norm) also
# returns the residual stream dropout(dense(...)) + x.
#
# Why. On the fused path the attention sublayer is three fused ops (QKV projection, attention, residual + dropout +
# LayerNorm) around PyTorch's output projection, whose autograd graph adds two CatBackward (the QKV weight and
# bias), a transpose, four views, a T and an addmm node a layer; the feed-forward one is two fused ops. Each node
# costs the backward engine's dispatch, and each fused op's node a Python call chain besides
# (`benchmarks/host_phases.py`: the backward was where the training step's host time lost to transformers'). Here
# one autograd.Function runs the same host functions in the same order (so the same dropout seeds are drawn and the
# results are bitwise those of the per-op path, tests/test_sublayer.py), and its backward calls each op's own
# registered backward on a stand-in context: one node, the same kernels, the same saved tensors (their memory,
# activation checkpointing's hooks and the in-place checks included).
#
# Where it runs: eager autograd (not traced: torch.compile and torch.export see the per-op custom ops), plain
# modules (no hooks, plain Linears (BERT's three QKV Linears with biases), readable dropouts), no attention
# probabilities, and the attention and LayerNorms on the path fastbert.ops resolves for them when called alone, a
# Triton one. MPNet's relative-position bias table, which every layer's attention reads, is an input of each node,
# whose backward returns that layer's share of its gradient (autograd sums them, as over the per-op nodes).
# Elsewhere the caller runs the ops one by one, as before (fastbert/modeling.py decides).
#
# The QKV projection runs here on any path it resolves to. Its PyTorch path ("torch": what backend="auto" chooses on
# an H100 at BERT-base's training shape) runs in its cuBLAS form (kernels/qkv.py's cublas_forward): the same forward,
# and in the backward the same three GEMMs (dx = dQKV @ W, dW = dQKV^T @ x, db = dQKV's column sums) over dQKV as
# attention's backward wrote it, where autograd's unbind backward would first stack dq, dk and dv into a copy of it
# (a pass over [tokens, 3H] a layer; 0.29 ms a BERT-base layer at 256 x 128 in the third H100 run's profile). The
# results are the per-op path's to the bit (tests/test_sublayer.py), and the step keeps one node a sublayer.
from __future__ import annotations

import torch

from fastbert import ops
from fastbert.kernels.fused_op import as_dtype, c_apply, once_differentiable


class _OpContext:
    """Stands for autograd's ctx of one op inside the sublayer: what the op's setup_context saves goes to the
    sublayer's ctx (one save_for_backward, so that saved-tensor hooks and the in-place checks see it), and the
    op's backward reads it back from there."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):  # none of the op's outputs leaves the sublayer but the last
        pass

    def set_materialize_grads(self, value):  # each op's backward is handed exactly the gradients it reads
        pass


def _save(ctx, contexts: tuple, *tensors) -> None:
    """Every op's saved tensors, then `tensors`, in the sublayer's one save_for_backward. No context holds a tensor
    outside the backward (`_restore`, `_release`): it would escape the saved-tensor hooks (activation checkpointing
    would free nothing), and the sublayer's output, which LayerNorm saves, would make a reference cycle with the
    node (the graph would live until Python's garbage collector ran)."""
    saved, counts = [], []
    for context in contexts:
        saved += context.saved_tensors
        counts.append(len(context.saved_tensors))
        context.saved_tensors = None
    ctx.save_for_backward(*saved, *tensors)
    ctx.contexts, ctx.counts = contexts, counts


def _restore(ctx) -> tuple:
    """Hands each op's context its saved tensors (ctx.saved_tensors unpacks them: the in-place checks and the
    saved-tensor hooks run there), until `_release`; returns the sublayer's own, the ones after."""
    saved, start = ctx.saved_tensors, 0
    for context, count in zip(ctx.contexts, ctx.counts):
        context.saved_tensors, start = saved[start:start + count], start + count
    return saved[start:]


def _release(contexts) -> None:
    """The end of a backward: the contexts let their tensors go (see `_save`)."""
    for context in contexts:
        context.saved_tensors = None


def _norm_forward(x, norm_weight, norm_bias, residual, dropout_p: float, eps: float, save_output: bool,
                  return_residual: bool):
    """LayerNorm(dropout(x) + residual) as fastbert.ops.layer_norm runs it: (the output, the summed residual stream
    (an empty tensor without return_residual), the op's context)."""
    norm_kernel = ops.KERNELS["layer_norm"]
    x, norm_weight, norm_bias, residual, out_dtype = ops._layer_norm_inputs(x, norm_weight, norm_bias, residual)
    norm_kernel.check_limits(x, norm_weight, norm_bias, residual, out_dtype)
    dropout_p, seed = norm_kernel.dropout_seed(dropout_p, True, x.device)  # layer_norm_unchecked's draw
    arguments = (x, norm_weight, norm_bias, residual, seed, float(eps), dropout_p, out_dtype, save_output,
                 return_residual)
    output = norm_kernel.layer_norm_fwd.function(*arguments)
    context = _OpContext()
    norm_kernel._setup_context(context, arguments, output)
    return output[0], output[2], context


def _norm_backward(context, dy, dsum, needs: tuple, x_dtype):
    """(d x in its dtype, d weight, d bias, d residual) of `_norm_forward`; dsum: the summed stream's gradient, or
    None; needs: those four's."""
    context.needs_input_grad = needs
    dx, dweight, dbias, dresidual = ops.KERNELS["layer_norm"]._backward(context, dy, None, dsum)[:4]
    return as_dtype(dx, x_dtype), dweight, dbias, dresidual


def _dtypes(*tensors) -> list:
    """Each tensor's dtype, None for None: one call (a generator would be a call per tensor, every layer)."""
    dtypes = []
    for t in tensors:
        dtypes.append(None if t is None else t.dtype)
    return dtypes


def _gradients(name: str, ctx, incoming: tuple, dhidden, dresidual, hidden_dtype, parameter_gradients: list,
               parameter_dtypes):
    """The sublayer backward's return: d hidden (the residual's gradient added), then each parameter's in its dtype
    (None where autograd needs none), then None for each argument past them. incoming: the gradients the backward
    was handed."""
    needs = ctx.needs_input_grad
    if needs[0]:
        dresidual = as_dtype(dresidual, hidden_dtype)
        dhidden = dresidual if dhidden is None else as_dtype(dhidden, hidden_dtype) + dresidual
    else:
        dhidden = None
    gradients = [dhidden, *parameter_gradients] + [None] * (len(needs) - 1 - len(parameter_gradients))
    for i, dtype in enumerate(parameter_dtypes, start=1):  # a loop, no call per gradient: every layer runs it
        gradient = gradients[i]
        if gradient is not None and (not needs[i] or gradient.dtype != dtype):
            gradients[i] = gradient.to(dtype) if needs[i] else None
    return once_differentiable(name, tuple(gradients), ctx, incoming)


class _AttentionSublayer(torch.autograd.Function):
    """norm(dropout(dense(attention(qkv(x)))) + hidden) with x = hidden (post-LN, BERT) or x = pre_norm(hidden)
    (pre-LN, ModernBERT, whose norm also returns the summed stream). qkv's weight is torch.cat((wq, wk, wv)) (BERT's
    three Linears: the gradients go back to each, as CatBackward hands them), or wq itself where wk is None
    (ModernBERT's Wqkv, [3H, H])."""

    # forward with ctx (old-style), called through autograd's C apply, as kernels/fused_op.py's EagerFunction
    @staticmethod
    def forward(ctx, hidden, wq, bq, wk, bk, wv, bv, wo, bo, norm_weight, norm_bias, pre_weight, pre_bias,
                relative_bias, options):
        (key_mask, cu_seqlens, max_seqlen, num_heads, attention_p, rotary_base, window, relative_buckets, hidden_p,
         eps, save_output, return_residual, cublas_forward) = options
        qkv_kernel, attention_kernel = ops.KERNELS["qkv"], ops.KERNELS["attention"]
        x, contexts = hidden, ()
        if pre_weight is not None:  # the pre-LayerNorm, as fastbert.ops.layer_norm runs it (no residual, no dropout)
            x, _, pre = _norm_forward(hidden, pre_weight, pre_bias, None, 0.0, eps, save_output, False)
            contexts = (pre,)
        # the QKV projection, as fastbert.ops.qkv_projection runs it: one dtype, the autocast one under autocast
        x_dtype = x.dtype
        if wk is None:
            x, weight, bias = ops._matmul_inputs(x, wq, bq)
        else:
            x, weight, bias = ops._matmul_inputs(x, torch.cat((wq, wk, wv)), torch.cat((bq, bk, bv)))
        qkv_kernel.check_limits(x, weight, bias)
        q, k, v = qkv_kernel._project(x, weight, bias, num_heads, cublas_forward)
        qkv = _OpContext()
        qkv.save_for_backward(x, weight)  # _QKVProjection.setup_context's
        # attention, as kernels/attention.py's attention_unchecked (padded) and attention_varlen_unchecked
        packed = cu_seqlens is not None
        seqlen = max_seqlen if packed else q.shape[2]
        key_mask = None if packed else key_mask
        attention_kernel.check_limits(q, k, v, key_mask, cu_seqlens, seqlen, None, relative_bias, relative_buckets,
                                      rotary_base, window)
        dropout_p, seed = attention_kernel.dropout_seed(attention_p, True, q.device)
        # rotary_base converted as the unchecked entries convert it
        arguments = (q, k, v, key_mask, cu_seqlens, seqlen, seed, dropout_p, q.shape[-1] ** -0.5, relative_bias,
                     relative_buckets, attention_kernel._float_or_none(rotary_base), window)
        out, lse = attention_kernel.attention_fwd.function(*arguments)
        attention = _OpContext()
        attention_kernel._setup_context(attention, arguments, (out, lse))
        # the output projection, as nn.Linear runs it (under autocast in the autocast dtype): the heads merged by
        # a view (attention writes [B, S, heads, d]), then one addmm (one mm without a bias)
        merged = (out if packed else out.transpose(1, 2)).reshape(-1, out.shape[-1] * num_heads)  # [tokens, H]
        dense_weight, dense_bias = wo, bo
        if ops._any_autocast():
            dense_weight, dense_bias = ops._cast((wo, bo), ops.autocast_dtype("matmul", hidden.device.type) or wo.dtype)
        projected = (torch.mm(merged, dense_weight.t()) if dense_bias is None
                     else torch.addmm(dense_bias, merged, dense_weight.t())).view(hidden.shape)
        output, summed, norm = _norm_forward(projected, norm_weight, norm_bias, hidden, hidden_p, eps, save_output,
                                             return_residual)
        _save(ctx, (*contexts, qkv, attention, norm), merged, dense_weight)
        # the dtypes the gradients go back to (autocast's and the promotions' casts, undone as their nodes would)
        ctx.dtypes = (hidden.dtype, x_dtype, projected.dtype,
                      _dtypes(wq, bq, wk, bk, wv, bv, wo, bo, norm_weight, norm_bias, pre_weight, pre_bias,
                              relative_bias))
        ctx.single = wk is None
        return (output, summed) if return_residual else output

    @staticmethod
    def backward(ctx, dy, dsum=None):
        merged, dense_weight = _restore(ctx)
        *pre, qkv, attention, norm = ctx.contexts
        hidden_dtype, x_dtype, projected_dtype, parameter_dtypes = ctx.dtypes
        needs = ctx.needs_input_grad
        needs_qkv = needs[1:7]
        needs_x = needs[0] or (bool(pre) and (needs[11] or needs[12]))  # the projection's input's: hidden's, pre_norm's
        needs_projection = needs_x or any(needs_qkv)
        upstream = needs_projection or needs[13]  # a gradient before the output projection (the bias table's too)
        dprojected, dnorm_weight, dnorm_bias, dresidual = _norm_backward(
            norm, dy, dsum, (upstream or needs[7] or needs[8], needs[9], needs[10], needs[0]), projected_dtype)
        dprojected = dprojected.view(merged.shape)  # [tokens, H]
        # the output projection, as PyTorch's addmm backward computes it
        dwo = dprojected.t() @ merged if needs[7] else None
        dbo = dprojected.sum(dim=0) if needs[8] else None
        dhidden, dqkv, dpre_weight, dpre_bias, drelative_bias = None, (None,) * 6, None, None, None
        if upstream:
            dmerged = dprojected @ dense_weight  # [tokens, H]
            del dprojected  # each gradient freed once used, as between the per-op nodes
            q = attention.saved_tensors[0]
            # in attention's output shape: [T, heads, d], or [B, heads, S, d] as a view of [B, S, heads, d]
            dout = (dmerged.view(q.shape) if q.dim() == 3
                    else dmerged.view(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2))
            attention_gradients = ops.KERNELS["attention"]._backward(attention, dout, None)
            # relative_bias is attention_fwd's input 9 (its arguments above)
            (dq, dk, dv), drelative_bias = attention_gradients[:3], attention_gradients[9]
            del dmerged, dout, attention_gradients
            dx = dweight = dbias = None
            if needs_projection:
                qkv.needs_input_grad = (needs_x, any(needs_qkv[0::2]), any(needs_qkv[1::2]))
                dx, dweight, dbias = ops.KERNELS["qkv"]._QKVProjection.backward(qkv, dq, dk, dv)[:3]
            del dq, dk, dv
            if ctx.single:
                dqkv = dweight, dbias, None, None, None, None
            else:  # the rows of each parameter, as CatBackward hands them
                dwq, dwk, dwv = (None,) * 3 if dweight is None else dweight.chunk(3)
                dbq, dbk, dbv = (None,) * 3 if dbias is None else dbias.chunk(3)
                dqkv = dwq, dbq, dwk, dbk, dwv, dbv
            if pre and needs_x:
                dhidden, dpre_weight, dpre_bias, _ = _norm_backward(pre[0], as_dtype(dx, x_dtype), None,
                                                                    (needs[0], needs[11], needs[12], False),
                                                                    hidden_dtype)
            else:
                dhidden = dx
        _release(ctx.contexts)
        return _gradients("attention sublayer", ctx, (dy, dsum), dhidden, dresidual, hidden_dtype,
                          [*dqkv, dwo, dbo, dnorm_weight, dnorm_bias, dpre_weight, dpre_bias, drelative_bias],
                          parameter_dtypes)


class _FeedForwardSublayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, w1, b1, w2, b2, norm_weight, norm_bias, approximate, keep_pre, form, hidden_p, eps,
                save_output):
        ffn_kernel = ops.KERNELS["ffn"]
        # the FFN, as fastbert.ops.feed_forward and kernels/ffn.py's feed_forward run it (no residual: the norm
        # below adds it)
        arguments = (*ops._matmul_inputs(hidden, w1, b1, w2, b2), approximate, keep_pre, False, form, None)
        ffn_kernel._check(*arguments[:6], False, form)
        output = ffn_kernel.feed_forward_fwd(*arguments)
        feed_forward = _OpContext()
        ffn_kernel._feed_forward_setup(feed_forward, arguments, output)
        projected = output[0]
        normed, _, norm = _norm_forward(projected, norm_weight, norm_bias, hidden, hidden_p, eps, save_output, False)
        _save(ctx, (feed_forward, norm))
        ctx.dtypes = hidden.dtype, projected.dtype, (w1.dtype, b1.dtype, w2.dtype, b2.dtype)
        return normed

    @staticmethod
    def backward(ctx, dy):
        _restore(ctx)
        feed_forward, norm = ctx.contexts
        hidden_dtype, projected_dtype, parameter_dtypes = ctx.dtypes
        needs = ctx.needs_input_grad
        dprojected, dnorm_weight, dnorm_bias, dresidual = _norm_backward(norm, dy, None, (any(needs[:5]), *needs[5:7],
                                                                                           needs[0]), projected_dtype)
        dx = dw1 = db1 = dw2 = db2 = None
        if any(needs[:5]):
            feed_forward.needs_input_grad = needs[:5]
            dx, dw1, db1, dw2, db2 = ops.KERNELS["ffn"]._feed_forward_backward(feed_forward, dprojected, None)[:5]
        _release(ctx.contexts)
        return _gradients("feed-forward sublayer", ctx, (dy,), dx, dresidual, hidden_dtype,
                          [dw1, db1, dw2, db2, dnorm_weight, dnorm_bias], parameter_dtypes)


_APPLY = c_apply(_AttentionSublayer)
_FEED_FORWARD_APPLY = c_apply(_FeedForwardSublayer)


def attention_sublayer(hidden, parameters: list, relative_bias, options: tuple):
    """norm(dropout(dense(attention(q, k, v))) + hidden), one autograd node (header): (q, k, v) by the QKV Linears
    of x = hidden, or of x = pre_norm(hidden) (a LayerNorm, or None). parameters: (weight, bias) of the QKV Linears
    (BERT's three: query, key, value; or one whose weight is all three's: ModernBERT's Wqkv), of dense, of norm and
    of pre_norm ((None, None) for none); a bias may be None. relative_bias: MPNet's table [buckets, heads], or None.
    hidden [B, S, H] (a key mask [B, S] or None) or packed [T, H] (cu_seqlens int32 [B + 1], max_seqlen). options:
    (key_mask, cu_seqlens, max_seqlen, num_heads, attention_p, rotary_base or None, window or None,
    relative_buckets (with relative_bias) or None, hidden_p, eps, save_output, return_residual, cublas_forward);
    with return_residual the output is (normed, the summed stream). The caller has checked that it may run
    (fastbert.modeling's SelfAttention.sublayer)."""
    *projections, dense, norm, pre_norm = parameters
    if len(projections) == 1:  # one Linear whose weight is all three's
        projections = (projections[0], (None, None), (None, None))
    (wq, bq), (wk, bk), (wv, bv) = projections
    return _APPLY(hidden, wq, bq, wk, bk, wv, bv, *dense, *norm, *pre_norm, relative_bias, options)


def feed_forward_sublayer(hidden, parameters: tuple, approximate: str, keep_pre: bool, form: str, hidden_p: float,
                          eps: float, save_output: bool):
    """norm(dropout(down(gelu(up(hidden)))) + hidden), BERT's FFN sublayer, as one autograd node (header).
    parameters: (weight, bias) of up, down and norm. keep_pre and form as kernels/ffn.py's forward takes them. The
    caller has checked that it may run (fastbert.modeling.fused_feed_forward_sublayer)."""
    (up_weight, up_bias), (down_weight, down_bias), (norm_weight, norm_bias) = parameters
    return _FEED_FORWARD_APPLY(hidden, up_weight, up_bias, down_weight, down_bias, norm_weight, norm_bias, approximate,
                               keep_pre, form, hidden_p, eps, save_output)
