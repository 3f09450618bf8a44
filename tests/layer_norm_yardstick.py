"""The tolerance rule's yardstick for the LayerNorm kernel's backward from its output (save="output") in fp16 and
bf16: what that mode promises is PyTorch's backward given what it keeps, the output rounded to 16 bits.

The kernel reads xhat back as (y - bias) / weight from the 16-bit y (kernels/layer_norm.py), so dweight, a sum
over rows of dy * xhat, adds up the rows' rounding of y: 2x to 5.3x the error of PyTorch's fused LayerNorm,
which rounds once (the seven cases of tests/test_layer_norm.py that failed on the first H100 run, whose PyTorch
rounds as tolerance.pytorch_in models it). This computes that backward exactly, in float64 from the rounded y,
each gradient rounded once: the kernel's error equals its own to three digits there, and a kernel that did worse
arithmetic than the information allows fails the rule against it as against PyTorch's."""
import torch

from fastbert.kernels import layer_norm as ln


def backward_from_rounded_output(x, residual, weight, bias, dy, eps, dsummed=None, keep=None, dropout_p=0.0,
                                 summed_as_stored=False):
    """{"dx", "dresidual" (with a residual), "dweight", "dbias" (with a bias)} of LayerNorm(dropout(x) +
    residual) * weight + bias for the upstream gradient dy (and dsummed, the gradient of the pre-norm rows
    summed), computed in float64 with xhat from y rounded to x's dtype (the small-weight columns, which the
    side buffer keeps, exact), each rounded once to its tensor's dtype. keep: the dropout keep-mask (x's
    shape); summed_as_stored: the rows are normalised as stored in x's dtype (return_residual)."""
    hidden = x.shape[-1]
    w = weight.double()
    b = torch.zeros_like(w) if bias is None else bias.double()
    h = x.double().reshape(-1, hidden)
    scale = None if keep is None else keep.double().reshape(-1, hidden) / (1.0 - dropout_p)
    if scale is not None:
        h = h * scale
    if residual is not None:
        h = h + residual.double().reshape(-1, hidden)
    if summed_as_stored:
        h = h.to(x.dtype).double()
    mean = h.mean(-1, keepdim=True)
    rstd = (((h - mean) ** 2).mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (h - mean) * rstd
    y = (xhat * w + b).to(x.dtype).double()
    xhat = torch.where(w.abs() < ln.MIN_WEIGHT, xhat, (y - b) / w)
    dy = dy.double().reshape(-1, hidden)
    g = dy * w
    dh = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsummed is not None:
        dh = dh + dsummed.double().reshape(-1, hidden)
    dx = dh if scale is None else dh * scale
    grads = {"dx": dx.reshape(x.shape).to(x.dtype), "dweight": (dy * xhat).sum(0).to(weight.dtype)}
    if residual is not None:
        grads["dresidual"] = dh.reshape(residual.shape).to(residual.dtype)
    if bias is not None:
        grads["dbias"] = dy.sum(0).to(bias.dtype)
    return grads
