"""The functional API: one function per fused op, and the one place that chooses between a Triton
kernel (`fastbert.kernels.<op>`) and the pure-PyTorch reference (`fastbert.reference`).

`backend` is "auto" (default; None means the same), "triton" or "torch".
- auto: on CUDA tensors (when Triton imports) the path measured fastest for the op's shape class on the
  nearest measured GPU architecture: the Triton kernel, the reference, or cuBLAS's GEMM followed by a
  Triton elementwise kernel (fastbert.paths, the committed table fastbert/paths.json); the reference
  otherwise (but as on a GPU for the meta tensors of a memory plan and the CPU tensors of a host-time
  measurement that stand for a GPU's). The environment variable FASTBERT_BACKEND=triton|torch changes what
  "auto" means.
- triton: the kernels. On CPU tensors this needs TRITON_INTERPRET=1 (Triton's interpreter);
  otherwise it raises RuntimeError rather than silently running something else.
- torch: the reference, everywhere.
Arguments are checked here, before any kernel runs, with errors that name the argument.

fp32 inputs to the matmul-type kernels (QKV projection, attention, the FFN up-projection, the MLM loss)
multiply as PyTorch's own fp32 matmuls do at the time of the call: in TF32 on tensor cores when PyTorch
allows it (`torch.backends.cuda.matmul.fp32_precision = "tf32"`, or `torch.set_float32_matmul_precision`
"high" / "medium"), else in exact IEEE fp32 (PyTorch's default, "highest"), which is several times slower.
"""
from __future__ import annotations

import importlib
import os

import torch
from torch.utils.checkpoint import checkpoint

from fastbert import paths, reference
from fastbert.kernels.arguments import (CROSS_ENTROPY_REDUCTIONS, check_cross_entropy_options,
                                       check_cross_entropy_shapes, check_max_seqlen, check_relative_bias,
                                       check_rotary_window)

BACKENDS = ("auto", "triton", "torch")
GELU_APPROXIMATIONS = ("none", "tanh")
REDUCTIONS = CROSS_ENTROPY_REDUCTIONS
LAYER_NORM_SAVES = ("output", "input")  # what the Triton LayerNorm's backward works from


# Resolved once, at import: torch.compile cannot trace an import, and dispatch runs inside traced code.
# Triton's interpreter is chosen when a kernel is defined, so TRITON_INTERPRET=1 must be set before
# fastbert is imported.
try:
    import triton  # noqa: F401
    TRITON_IMPORT_ERROR = None  # None when Triton imports, else why not
except Exception as exc:  # ImportError, or a broken install raising anything else
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
KERNEL_FILES = ("layer_norm", "bias_gelu", "ffn", "qkv", "attention", "mlm_loss", "dropout")
KERNELS = {} if TRITON_IMPORT_ERROR else {
    name: importlib.import_module(f"fastbert.kernels.{name}") for name in KERNEL_FILES}
# the head dims the Triton attention takes; "auto" runs the reference for others (resolve_backend's kernel_fits)
ATTENTION_HEAD_DIMS = KERNELS["attention"].SUPPORTED_HEAD_DIMS if KERNELS else ()


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# True while fastbert.simulated.host_time.stubbed_launches() is entered: Triton's active driver is a stand-in
# GPU's whose launches run nothing, so backend="triton" takes CPU tensors and the kernels' host code runs on
# them as on the GPU (`fastbert bench --suite host`)
_LAUNCHES_STUBBED = [False]
# what backend="auto" runs on CPU tensors while the launches are stubbed: None, the reference (as without the
# stubs); or a paths.recorded_choices table, a GPU's choices, so that the host code timed is that GPU's
_STUBBED_AUTO: list[dict | None] = [None]


def set_launches_stubbed(stubbed: bool) -> None:
    _LAUNCHES_STUBBED[0] = stubbed
    _STUBBED_AUTO[0] = None


def set_stubbed_auto(choices: dict | None) -> None:
    """What backend="auto" runs on CPU tensors from now until the stubs go: what a GPU ran (a
    paths.recorded_choices table: the op's recorded choice, the kernel where "auto" has no choice to make) or None,
    the reference. Raises RuntimeError unless the launches are stubbed: without the stubs a kernel cannot take CPU
    tensors."""
    if not _LAUNCHES_STUBBED[0]:
        raise RuntimeError("set_stubbed_auto needs stubbed launches (fastbert.simulated.host_time.stubbed_launches): "
                           "without them a kernel cannot run on CPU tensors")
    _STUBBED_AUTO[0] = choices


def auto_as_gpu(t: torch.Tensor) -> bool:
    """Whether backend="auto" chooses for t, not a CUDA tensor, as on a GPU: a meta tensor inside a memory plan
    (paths.planned_architecture), a CPU tensor while the stubbed launches hold a GPU's choices (set_stubbed_auto)."""
    return paths.planned_capability() is not None if t.is_meta else _STUBBED_AUTO[0] is not None


# the ops whose kernels compute in the autocast dtype: under autocast, their table rows are that dtype's
MATMUL_OPS = frozenset({"linear_bias_gelu", "feed_forward", "feed_forward_geglu", "qkv_projection", "attention",
                        "linear_cross_entropy"})


def _devices(tensors) -> str:
    """"cuda" or "meta" when every tensor (None skipped) is on that kind of device, else "other"."""
    kind = None
    for t in tensors:
        if t is not None:
            here = "cuda" if t.is_cuda else "meta" if t.is_meta else "other"
            if kind is None:
                kind = here
            elif here != kind:
                return "other"
    return kind or "other"


# FASTBERT_BACKEND is read on every op call of the default path ("auto"), as users and tests may set it at run
# time. os.environ.get encodes the key and decodes the value on every read (1.3 us, ~60 op calls a BERT-base
# forward); CPython keeps the environment in a dict of encoded keys (os.environ._data), which os.environ's
# setters update: reading that dict costs 0.1 us. Where it is missing (another Python), os.environ.get.
_ENVIRONMENT = getattr(os.environ, "_data", None)
_BACKEND_KEY = os.environ.encodekey("FASTBERT_BACKEND") if _ENVIRONMENT is not None else None


def _backend_from_environment() -> str:
    """FASTBERT_BACKEND's value now, "" when unset."""
    if _ENVIRONMENT is None:
        return os.environ.get("FASTBERT_BACKEND", "")
    value = _ENVIRONMENT.get(_BACKEND_KEY)
    return "" if value is None else os.environ.decodevalue(value)


def resolve_backend(backend: str | None, *tensors: torch.Tensor | None, op: str | None = None,
                    kernel_fits: bool = True) -> str:
    """Return the path to run for these tensors: "triton", "torch", or, for "auto" on a GPU where
    fastbert.paths' table chooses it, "cublas_then_bias_gelu" (op linear_bias_gelu and the FFNs) or
    "cublas_forward" (op qkv_projection); raise if the request cannot run. op: the fastbert.paths op whose
    measurements "auto" reads on a GPU (the tensors as paths.SIZES takes them, the op's input first); None:
    "auto" means the kernel there. kernel_fits False: the kernel does not take these shapes (an attention head
    dim outside ATTENTION_HEAD_DIMS), so "auto" runs the reference, and "triton" is left to the kernel's check
    to refuse. Runs on every op call: a few attribute reads."""
    if backend is None or backend == "auto":
        env = _backend_from_environment()
        if env in ("triton", "torch"):
            backend = env
        elif env not in ("", "auto"):
            raise ValueError(f"FASTBERT_BACKEND must be 'auto', 'triton' or 'torch', got {env!r}")
        else:
            devices = _devices(tensors)
            # meta tensors stand for CUDA tensors in a memory plan (fastbert.simulated.meta_gpu), of the planned
            # GPU (paths.planned_architecture); outside a plan "auto" means the reference on them
            capability = paths.planned_capability() if devices == "meta" else None
            # CPU tensors of a host-time measurement that stand for a GPU's take its recorded choices
            recorded = _STUBBED_AUTO[0] if devices == "other" else None
            if (TRITON_IMPORT_ERROR is not None or not kernel_fits
                    or not (devices == "cuda" or capability or recorded is not None)):
                return "torch"
            if op is None:
                return "triton"
            only = paths.ONLY_CANDIDATE.get(op)
            if only is not None:
                return only
            if recorded is not None:
                return paths.recorded_choice(recorded, op, tensors)
            first = tensors[0]
            # planned meta tensors read CUDA's autocast state too (autocast_dtype)
            dtype = (autocast_dtype("matmul", "cuda") if op in MATMUL_OPS else None) or first.dtype
            return paths.choose(op, tensors, dtype, capability or paths.device_capability(first.device))
    if backend == "torch":
        return backend
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"backend='triton' was requested but Triton does not import ({TRITON_IMPORT_ERROR})")
    # meta tensors: the launchers run their host code on them in a memory plan, where the stand-in driver
    # launches nothing (outside a plan, the custom ops run their shape-only fake registrations on meta)
    if _devices(tensors) == "other" and not _LAUNCHES_STUBBED[0] and not interpreter_enabled():
        devices = sorted({str(t.device) for t in tensors if t is not None})
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors, got tensors on {devices}; set TRITON_INTERPRET=1 "
            "(before importing fastbert) to run the kernels on CPU in Triton's interpreter, "
            "or use backend='torch'")
    return backend


def check_backend(backend: str | None, device: torch.device | str, flag: str = "--backend") -> None:
    """Raise now, as a ValueError naming `flag` (or FASTBERT_BACKEND, which "auto" follows), what resolve_backend
    would raise at the first op of a model on `device` asked for `backend`, so that a command refuses it with its
    other options, before any work. The model's tensors are stood in for by an empty one that resolve_backend
    tells apart as it tells theirs: a CPU one for any device but CUDA, a meta one (a memory plan's stand-in for
    CUDA) for CUDA, which leaves the GPU untouched."""
    try:
        resolve_backend(backend, torch.empty(0, device="meta" if torch.device(device).type == "cuda" else "cpu"))
    except RuntimeError as exc:  # a bad name, FASTBERT_BACKEND's included, is resolve_backend's ValueError
        environment = os.environ.get("FASTBERT_BACKEND", "")
        what = (f"FASTBERT_BACKEND={environment} (which {flag} {backend} follows)" if backend in (None, "auto")
                and environment else f"{flag} {backend}")
        raise ValueError(f"{what} cannot run on the device here, {torch.device(device)}: {exc}") from None


# Custom ops are invisible to autocast, so the Triton path casts each kernel's inputs as autocast would
# cast the PyTorch op the kernel replaces (PyTorch's autocast op lists): matmuls (linear, the projections,
# the MLM decoder) and scaled_dot_product_attention run in the autocast dtype on every device; x + bias,
# gelu and dropout are never autocast. One deliberate deviation: under CUDA autocast PyTorch runs
# layer_norm in fp32 and returns fp32, which makes the whole residual stream fp32 (an fp32 copy of every
# 16-bit sublayer output, and a 16-bit copy of the stream saved by each matmul besides); the Triton
# LayerNorm instead reads its inputs as they come, computes in fp32, and returns the autocast dtype: a
# 16-bit residual stream, as Megatron-LM's bf16 training and apex's mixed-precision LayerNorm keep it.
# CPU autocast leaves layer_norm alone on both paths. The casts are differentiable, so fp32 master
# weights still receive their gradients.
def autocast_dtype(op: str, device_type: str) -> torch.dtype | None:
    """The dtype autocast runs `op` ("matmul" or "layer_norm") in on `device_type` now, for layer_norm the
    dtype it returns (the autocast dtype on CUDA: the deviation above); None when autocast is off or
    leaves the op alone. Meta tensors answer as CUDA ones: in a memory plan they stand for CUDA
    tensors, under CUDA autocast switched on by fastbert.simulated.meta_gpu (autocast has no "meta" state)."""
    device_type = "cuda" if device_type == "meta" else device_type
    if not torch.is_autocast_enabled(device_type):
        return None
    if op == "layer_norm" and device_type != "cuda":
        return None
    return torch.get_autocast_dtype(device_type)


# whether autocast is on for CPU, CUDA or another device type whose autocast a dispatch key carries (not MPS's,
# whose tensors never take the Triton path): one C call, where autocast_dtype reads the device's type first
_any_autocast = torch._C._is_any_autocast_enabled


def _cast(tensors, dtype):
    return [t.to(dtype) if t is not None and t.dtype != dtype and t.is_floating_point() else t for t in tensors]


def _matmul_inputs(*tensors):
    """One dtype for every operand of a matmul-type kernel: the autocast dtype, else the first tensor's."""
    first = tensors[0]
    # autocast off everywhere (one C call) spares reading the device's type (a torch.device made, then its type)
    dtype = (_any_autocast() and autocast_dtype("matmul", first.device.type)) or first.dtype
    for t in tensors:  # a loop, not all(generator): this runs on every matmul-type op call
        if t is not None and t.dtype != dtype:
            return _cast(tensors, dtype)
    return tensors


def _layer_norm_inputs(x, weight, bias, residual):
    """(x, weight, bias, residual, output dtype): x and residual in their promoted dtype (the kernel takes
    them in one; it upcasts each element itself, so no fp32 copy of a 16-bit activation is made), weight
    and bias as they are (it reads them in their own dtype, as F.layer_norm does); the output in the
    autocast dtype under CUDA autocast, else in x's."""
    if residual is not None and residual.dtype != x.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    return x, weight, bias, residual, (_any_autocast() and autocast_dtype("layer_norm", x.device.type)) or x.dtype


def _check_last_dim(name: str, tensor: torch.Tensor, size: int, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{name} is a 0-d tensor, expected a last dimension of {size} ({what})")
    if tensor.shape[-1] != size:
        raise ValueError(f"{name} has last dimension {tensor.shape[-1]}, expected {size} ({what})")


def _check_vector(name: str, tensor: torch.Tensor | None, size: int, what: str) -> None:
    """A bias: a tensor [size]."""
    if not isinstance(tensor, torch.Tensor) or tensor.shape != (size,):
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
        raise ValueError(f"{name} has shape {shape!r}, expected ({size},) ({what})")


def _check_dropout(dropout_p: float, name: str = "dropout_p") -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p!r}")


def _layer_norm_argument_error(x, weight, bias, eps, residual, dropout_p, save, return_residual):
    """Raise ValueError for the first argument of `layer_norm` it does not take."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., H], got a 0-d tensor")
    hidden = x.shape[-1]
    _check_last_dim("weight", weight, hidden, "x's hidden size")
    if bias is not None:
        _check_last_dim("bias", bias, hidden, "x's hidden size")
    if weight.dim() != 1 or (bias is not None and bias.dim() != 1):
        name, tensor = ("weight", weight) if weight.dim() != 1 else ("bias", bias)
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({hidden},) (x's hidden size)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's shape {tuple(x.shape)}")
    if return_residual and residual is None:
        raise ValueError("return_residual=True needs a residual (summed = dropout(x) + residual), got residual=None")
    _check_dropout(dropout_p)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    raise ValueError(f"save must be one of {LAYER_NORM_SAVES}, got {save!r}")


def layer_norm(x, weight, bias, eps=1e-12, residual=None, dropout_p=0.0, training=True, backend=None,
               save="output", return_residual=False):
    """LayerNorm(dropout(x) + residual) over the last dim (residual=None: LayerNorm(dropout(x))).

    x, residual [..., H]; weight [H]; bias [H] or None (no bias, as nn.LayerNorm(bias=False)). Returns
    [..., H] in x's dtype promoted with residual's; under CUDA autocast in fp32 on the torch path (as
    F.layer_norm) and in the autocast dtype on the Triton path (see the autocast note above).
    return_residual=True (needs a residual) returns (normed, summed): summed = dropout(x) + residual
    [..., H] in x's dtype promoted with residual's, the pre-LN residual stream, and normed its LayerNorm;
    both are differentiable. save (Triton path): "output" keeps the output and rstd for the backward
    (exact unless more than 8 weights are below 1/4 in magnitude: then NaN gradients, see
    kernels/layer_norm.py); "input" keeps x and the residual (with return_residual: summed instead),
    exact for any weight. Raises ValueError naming a bad argument.
    """
    hidden = x.shape[-1] if x.dim() else -1  # 0-d: no weight fits, and the error below says why
    # one condition for the arguments that pass (every call of every layer), the messages for those that do not
    if not (weight.dim() == 1 and weight.shape[0] == hidden
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == hidden))
            and (residual.shape == x.shape if residual is not None else not return_residual)
            and 0.0 <= dropout_p < 1.0 and eps > 0 and (save == "output" or save == "input")):
        _layer_norm_argument_error(x, weight, bias, eps, residual, dropout_p, save, return_residual)
    if resolve_backend(backend, x, weight, bias, residual, op="layer_norm") == "triton":
        x, weight, bias, residual, out_dtype = _layer_norm_inputs(x, weight, bias, residual)
        kernel = KERNELS["layer_norm"]
        kernel.check_limits(x, weight, bias, residual, out_dtype)  # the shapes and options are checked above
        return kernel.layer_norm_unchecked(x, weight, bias, eps, residual, dropout_p, training, out_dtype, save,
                                           return_residual)
    return reference.layer_norm(x, weight, bias, eps, residual, dropout_p, training, return_residual)


def bias_gelu(x, bias, approximate="none", backend=None):
    """gelu(x + bias); x [..., N], bias [N]; approximate "none" (exact erf) or "tanh". Returns the dtype
    x + bias has (autocast does not touch it)."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., N], got a 0-d tensor")
    _check_vector("bias", bias, x.shape[-1], "x's last dimension")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    if resolve_backend(backend, x, bias, op="bias_gelu") == "triton":
        if x.dtype != bias.dtype:  # x + bias, as PyTorch promotes it
            x, bias = _cast((x, bias), torch.promote_types(x.dtype, bias.dtype))
        return KERNELS["bias_gelu"].bias_gelu(x, bias, approximate)
    return reference.bias_gelu(x, bias, approximate)


def linear_bias_gelu(x, weight, bias, approximate="none", backend=None):
    """gelu(x @ weight.T + bias), the FFN up-projection and its activation.

    x [..., K]; weight [N, K]; bias [N]. backend="triton" runs kernels/bias_gelu.py's LINEAR_BIAS_GELU_FORM
    (a matmul with bias + GELU in its epilogue); "auto" on a GPU may run its other form, cuBLAS then the
    bias + GELU kernel ("cublas_then_bias_gelu"), where fastbert.paths measured it faster.
    """
    _check_last_dim("weight", weight, x.shape[-1], "x's last dimension")
    _check_vector("bias", bias, weight.shape[0], "weight's output size")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    path = resolve_backend(backend, x, weight, bias, op="linear_bias_gelu")
    if path != "torch":
        x, weight, bias = _matmul_inputs(x, weight, bias)
        return KERNELS["bias_gelu"].linear_bias_gelu(x, weight, bias, approximate,
                                                     form=None if path == "triton" else path)
    return reference.linear_bias_gelu(x, weight, bias, approximate)


def qkv_projection(x, weight, bias, num_heads, backend=None):
    """x [B, S, H] -> (q, k, v) each [B, heads, S, H/heads]; packed x [T, H] -> each [T, heads, H/heads].

    weight [3H, H] (query, key, value rows in that order), bias [3H] or None (no bias).
    """
    hidden = x.shape[-1]
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, S, H] or [T, H], got shape {tuple(x.shape)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"num_heads ({num_heads!r}) must be a positive int that divides the hidden size {hidden}")
    if weight.shape != (3 * hidden, hidden):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {(3 * hidden, hidden)}")
    if bias is not None and bias.shape != (3 * hidden,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {(3 * hidden,)}")
    path = resolve_backend(backend, x, weight, bias, op="qkv_projection")
    if path != "torch":
        x, weight, bias = _matmul_inputs(x, weight, bias)
        kernel = KERNELS["qkv"]
        kernel.check_limits(x, weight, bias)  # the shapes are checked above
        return kernel.qkv_projection_unchecked(x, weight, bias, num_heads, path == "cublas_forward")
    return reference.qkv_projection(x, weight, bias, num_heads)


def _check_attention_args(q, k, v, attention_mask, dropout_p, relative_bias, rotary_base, window) -> None:
    """q [B, heads, S, d]; k, v [B, heads, P + S, d] (P >= 0 prefix keys); attention_mask [B, P + S] or None."""
    # (B, heads, d) alike, read from the shapes without a call (each is host time on every layer)
    if (q.dim() != 4 or k.shape != v.shape or k.shape[:2] + k.shape[3:] != q.shape[:2] + q.shape[3:]
            or k.shape[2] < q.shape[2]):
        raise ValueError(f"q, k, v must be [B, heads, S, d] with k and v [B, heads, P + S, d] (P >= 0 prefix keys), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, _, keys, _ = k.shape
    if attention_mask is not None and attention_mask.shape != (batch, keys):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, keys)} "
                         f"(batch, keys)")
    if keys != q.shape[2] and (relative_bias is not None or rotary_base is not None or window is not None):
        raise ValueError(f"prefix keys ({keys - q.shape[2]} more keys than queries) have no position: they take no "
                         "relative_bias, rotary_base or window")
    _check_dropout(dropout_p)


relative_position_buckets = reference.relative_position_buckets


def attention(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, training=True, backend=None,
              relative_bias=None, relative_buckets=None, rotary_base=None, window=None):
    """softmax(q k^T * scale + key padding mask + relative-position bias) v, bidirectional.

    q, k, v [B, heads, S, d]; attention_mask [B, S], 1 = token, 0 = padding (bool or int).
    k and v may hold P prefix keys before the queries' own, [B, heads, P + S, d], with attention_mask [B, P + S]
    (PEFT's prefix tuning, transformers' cache): the reference runs them ("triton" is an error: the kernel
    takes as many keys as queries), with no relative_bias, rotary_base or window.
    scale defaults to d ** -0.5. Padded query rows come out as zeros; never NaN.
    relative_bias [num_buckets, heads] (any float dtype: MPNet's relative_attention_bias.weight, which gets
    its gradient) with relative_buckets int32 [2D + 1] from `relative_position_buckets`, or both None:
    score (i, j) of head h gets relative_bias[relative_buckets[clamp(j - i, -D, D) + D], h].
    rotary_base (RoPE's theta, or None): q and k rotated at their position, the row index (transformers'
    rotate_half layout); window (or None): only keys with |i - j| <= window (ModernBERT's local layers).
    """
    _check_attention_args(q, k, v, attention_mask, dropout_p, relative_bias, rotary_base, window)
    check_relative_bias(relative_bias, relative_buckets, q.shape[1], q.device)
    check_rotary_window(rotary_base, window, q.shape[-1])
    # SDPA is a candidate path only for plain dense attention (fastbert.paths)
    plain = attention_mask is None and relative_bias is None and rotary_base is None and window is None
    prefixed = k.shape[2] != q.shape[2]
    path = resolve_backend(backend, q, k, v, attention_mask, relative_bias, relative_buckets,
                           op="attention" if plain else None,
                           kernel_fits=q.shape[-1] in ATTENTION_HEAD_DIMS and not prefixed)
    if path == "triton" and prefixed:
        raise ValueError(f"backend='triton' cannot run prefix keys (k has {k.shape[2]} keys, q {q.shape[2]} queries): "
                         "the attention kernel takes as many keys as queries; use backend 'auto' or 'torch'")
    if path == "triton":
        q, k, v = _matmul_inputs(q, k, v)
        kernel = KERNELS["attention"]
        kernel.check_limits(q, k, v, attention_mask, None, q.shape[2], None, relative_bias, relative_buckets,
                            rotary_base, window)  # the arguments' own rules are checked above
        return kernel.attention_unchecked(q, k, v, attention_mask, dropout_p, scale, training, relative_bias,
                                          relative_buckets, rotary_base, window)
    return reference.attention(q, k, v, attention_mask, dropout_p, scale, training, relative_bias, relative_buckets,
                               rotary_base, window)


def attention_with_probs(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, training=True, relative_bias=None,
                         relative_buckets=None, rotary_base=None, window=None):
    """`attention` plus the attention probabilities [B, heads, S, P + S] (transformers' output_attentions).
    The probabilities are materialised, which is what a fused kernel avoids, so this runs the
    reference on every backend."""
    _check_attention_args(q, k, v, attention_mask, dropout_p, relative_bias, rotary_base, window)
    check_relative_bias(relative_bias, relative_buckets, q.shape[1], q.device)
    check_rotary_window(rotary_base, window, q.shape[-1])
    return reference.attention_with_probs(q, k, v, attention_mask, dropout_p, scale, training, relative_bias,
                                          relative_buckets, rotary_base, window)


def attention_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, scale=None, training=True, backend=None,
                     relative_bias=None, relative_buckets=None, rotary_base=None, window=None):
    """Attention over packed sequences: q, k, v [T, heads, d]; cu_seqlens int32 [B+1] (0, ..., T);
    max_seqlen the longest sequence. Each token attends to the tokens of its own sequence only.
    relative_bias, relative_buckets, rotary_base, window as in `attention`, with the positions inside each
    sequence. cu_seqlens' values are not checked (reading them would wait for the GPU; the models check theirs):
    rows past cu_seqlens[-1] belong to no sequence, and the kernels leave them and their gradients unwritten,
    as flash-attn's varlen attention does (the reference writes zeros)."""
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one [T, heads, d] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be int32 [B+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    check_max_seqlen(max_seqlen, q.shape[0])
    _check_dropout(dropout_p)
    check_relative_bias(relative_bias, relative_buckets, q.shape[1], q.device)
    check_rotary_window(rotary_base, window, q.shape[-1])
    if resolve_backend(backend, q, k, v, cu_seqlens, relative_bias, relative_buckets,
                       kernel_fits=q.shape[-1] in ATTENTION_HEAD_DIMS) == "triton":
        q, k, v = _matmul_inputs(q, k, v)
        kernel = KERNELS["attention"]
        kernel.check_limits(q, k, v, None, cu_seqlens, max_seqlen, None, relative_bias, relative_buckets,
                            rotary_base, window)  # the arguments' own rules are checked above
        return kernel.attention_varlen_unchecked(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, training,
                                                 relative_bias, relative_buckets, rotary_base, window)
    return reference.attention_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, training, relative_bias,
                                      relative_buckets, rotary_base, window)


unpad = reference.unpad
pad = reference.pad


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, backend=None):
    """Cross entropy of x @ weight.T + bias, never holding the full [N, V] logits.

    x [N, H]; weight [V, H]; bias [V] or None; target int [N] in [0, V) or ignore_index.
    Returns (loss fp32 scalar, num_correct int64 scalar). "mean" divides by the labelled rows;
    no labelled row gives loss 0 and zero gradients. Target values are not checked here (a device check per call
    would cost more host time than the op; the models' heads check their labels): one outside [0, V) that is not
    ignore_index gives the Triton path a NaN loss and NaN gradients, the reference PyTorch's index error.
    """
    # the differentiable inputs, as fastbert.paths reads them; not target, which inputs_pass (or check_inputs) holds
    # to x's device where the kernels run
    if resolve_backend(backend, x, weight, bias, op="linear_cross_entropy") == "triton":
        kernel = KERNELS["mlm_loss"]
        # autocast off and inputs the kernels take as they are (every call of a model's loss): one condition
        if _any_autocast() or not kernel.inputs_pass(x, weight, bias, target, reduction, label_smoothing):
            x, weight, bias = _matmul_inputs(x, weight, bias)
            kernel.check_inputs(x, weight, bias, target, reduction, label_smoothing)
        return kernel.linear_cross_entropy_unchecked(x, weight, bias, target, ignore_index, reduction,
                                                     label_smoothing)
    check_cross_entropy_shapes(x, weight, bias, target)
    check_cross_entropy_options(reduction, label_smoothing)
    return reference.linear_cross_entropy(x, weight, bias, target, ignore_index, reduction, label_smoothing)


def _check_feed_forward_args(x, w1, b1, w2, b2, approximate, gated, residual) -> None:
    if w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"w1 and w2 must be 2-D, got shapes {tuple(w1.shape)} and {tuple(w2.shape)}")
    _check_last_dim("w1", w1, x.shape[-1], "x's last dimension")
    if gated and w1.shape[0] % 2:
        raise ValueError(f"w1 has {w1.shape[0]} rows; the GeGLU's w1 is [2I, K] (input rows, then gate rows), "
                         f"so they must be even")
    inner = w1.shape[0] // 2 if gated else w1.shape[0]
    if b1 is not None:
        _check_vector("b1", b1, w1.shape[0], "w1's output size")
    _check_last_dim("w2", w2, inner, "w1's output size halved (I)" if gated else "w1's output size")
    if b2 is not None:
        _check_vector("b2", b2, w2.shape[0], "w2's output size")
    if residual is not None and residual.shape != (*x.shape[:-1], w2.shape[0]):
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected the output's "
                         f"{(*x.shape[:-1], w2.shape[0])} (x's leading dimensions, w2's output size)")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def feed_forward(x, w1, b1, w2, b2, approximate="none", recompute_pre=False, backend=None, residual=None,
                 residual_in_place=False):
    """gelu(x @ w1.T + b1) @ w2.T + b2, BERT's FFN, whose backward keeps the pre-activation
    x @ w1.T + b1 but not the GELU output (recomputed from it): kernels/ffn.py.

    x [..., K]; w1 [N, K]; b1 [N] or None; w2 [K2, N]; b2 [K2] or None. Returns [..., K2] in the matmul
    dtype (the autocast dtype under autocast). recompute_pre (`--activation-checkpointing ffn`) keeps only
    x: the Triton path reruns the up-projection in the backward, the reference (no fused op to ask) reruns
    the whole FFN under torch.utils.checkpoint. residual [..., K2] or None: returns residual + the FFN, as
    PyTorch's `+` gives it (its dtype promoted with the output's); the Triton path adds a residual of the
    output's dtype in the down-projection (no add op of its own). residual_in_place: the residual may be
    overwritten with the result (a layer's stream, dead after its FFN): the Triton path's inference call (grad
    mode off, nothing traced, no forward-mode AD, plain tensors off the meta device) then has the GEMM accumulate
    onto it and returns it. Raises ValueError naming a mismatched argument or the approximation.
    """
    return _feed_forward("feed_forward", x, w1, b1, w2, b2, approximate, recompute_pre, backend, residual,
                         residual_in_place)


def feed_forward_geglu(x, w1, b1, w2, b2, approximate="none", recompute_pre=False, backend=None, residual=None,
                       residual_in_place=False):
    """(gelu(h[..., :I]) * h[..., I:]) @ w2.T + b2 with h = x @ w1.T + b1: ModernBERT's GeGLU FFN
    (transformers' ModernBertMLP without its dropout), whose backward keeps h (both halves) but not the
    GeGLU output: kernels/ffn.py, gated.

    x [..., K]; w1 [2I, K] (the input rows, then the gate rows: transformers' Wi.weight); b1 [2I] or None;
    w2 [K2, I]; b2 [K2] or None. Returns [..., K2] in the matmul dtype (the autocast dtype under autocast).
    recompute_pre, residual (ModernBERT's stream) and residual_in_place as in `feed_forward`. Raises ValueError
    naming a mismatched argument or the approximation.
    """
    return _feed_forward("feed_forward_geglu", x, w1, b1, w2, b2, approximate, recompute_pre, backend, residual,
                         residual_in_place)


def _feed_forward(name, x, w1, b1, w2, b2, approximate, recompute_pre, backend, residual, residual_in_place):
    """feed_forward or feed_forward_geglu (`name`, the function of that name in kernels/ffn.py and in the
    reference), checked, then dispatched."""
    _check_feed_forward_args(x, w1, b1, w2, b2, approximate, name == "feed_forward_geglu", residual)
    path = resolve_backend(backend, x, w1, b1, w2, b2, residual, op=name)
    if path != "torch":
        x, w1, b1, w2, b2 = _matmul_inputs(x, w1, b1, w2, b2)
        # a residual of another dtype is added as `+` adds it, promoting: the unfused layer's result
        fused = residual if residual is None or residual.dtype == x.dtype else None
        out = getattr(KERNELS["ffn"], name)(x, w1, b1, w2, b2, approximate, recompute_pre,
                                            form="epilogue" if path == "triton" else path, residual=fused,
                                            residual_in_place=residual_in_place)
        return out if fused is residual else residual + out
    function = getattr(reference, name)
    if recompute_pre and torch.is_grad_enabled():
        out = checkpoint(function, x, w1, b1, w2, b2, approximate, use_reentrant=False)
    else:
        out = function(x, w1, b1, w2, b2, approximate)
    return out if residual is None else residual + out


def dropout(x, p, training=True, backend=None):
    """Dropout: each element zeroed with probability p, the rest scaled by 1 / (1 - p); x unchanged when
    not training or p == 0. x [...]: any floating dtype on the torch path (F.dropout, which stores a
    mask), fp32/fp16/bf16 on the Triton path, which stores no mask (forward and backward draw it from a
    seed). Returns x's shape and dtype. Raises ValueError for p outside [0, 1).
    """
    _check_dropout(p, "p")
    if resolve_backend(backend, x) == "triton":
        kernel = KERNELS["dropout"]
        kernel.check_limits(x)
        return kernel.dropout_unchecked(x, p, training)
    return reference.dropout(x, p, training)
