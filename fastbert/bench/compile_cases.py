"""What the compile audit calls: every host launcher of kernels/*.py, the way the model calls it, at BERT-base
and BERT-large shapes (padded batches and packed tokens, S = 128 and 512) in fp32, fp16 and bf16, with the
variants the model runs (dropout on and off, exact and tanh GELU, LayerNorm with and without residual).

Inputs are meta tensors: shapes, strides and alignments without storage. The launchers run as they do on a
GPU (their checks, their tile choices, the torch ops around the kernels, all free on meta), and the kernels
are compiled but never run (see stand_in_gpu). Integer arguments are what Triton specialises on (equal to 1,
divisible by 16), so the shapes are real ones: 16,384 token slots per batch as the GPU suite's op cases
(B = 128 at S = 128, 32 at S = 512), lengths uniform in [S/4, S], 15% of the tokens labelled for the MLM
loss, and a few small label counts of a fine-tuning batch.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from fastbert.bench.op_cases import LAYER_NORM_EPS, random_lengths


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    heads: int
    intermediate: int
    vocab: int


MODELS = (Model("bert-base", 768, 12, 3072, 30522), Model("bert-large", 1024, 16, 4096, 30522))
TOKEN_SLOTS = 16384  # B x S of every padded batch
SEQLENS = (128, 512)
LAYOUTS = ("padded", "varlen")
# "float32+tf32": fp32 tensors with TF32 dots allowed (torch.set_float32_matmul_precision("high")); plain
# "float32" is PyTorch's default, exact fp32 ("highest"), which the launchers read when they run
DTYPES = ("float32", "float32+tf32", "float16", "bfloat16")
MLM_LABELLED = 0.15
FEW_LABELLED_ROWS = (1, 20, 40)  # a fine-tuning batch's MLM rows: the launchers' smallest row tiles
DROPOUT_P = 0.1
# MPNet's relative-position bias in attention (HAS_REL_BIAS): MPNet-base's attention is BERT-base's (12 heads
# of 64), run at its longest sequences, with its bucket table (32 buckets, max distance 128) and the bias
# table an fp32 Embedding weight whatever the activations' dtype
RELATIVE_BIAS_BATCHES = (("bert-base", 512),)  # (model, seqlen)
RELATIVE_BIAS_BUCKETS, RELATIVE_BIAS_MAX_DISTANCE = 32, 128
GELU_APPROXIMATIONS = ("none", "tanh")
IGNORE_INDEX = -100
# ModernBERT-base's kernels without biases (issue 20): the GeGLU FFN (I = 1152, exact GELU), the bias-less QKV
# projection and the pre-LN LayerNorm (no bias; the residual stream out), on one packed batch of 8 x 512 tokens,
# in the 16-bit dtypes it trains and runs in
MODERNBERT = Model("modernbert-base", 768, 12, 1152, 50368)
MODERNBERT_ROWS = 8 * 512
MODERNBERT_DTYPES = ("float16", "bfloat16")
# ModernBERT-base's attention (12 heads of 64) at its pre-training length and its longest, padded and packed:
# rotary positions on every layer (global layers' theta), and a local layer's window (|i - j| <= 64,
# config.sliding_window, what the model passes) with its theta; no attention dropout (ModernBERT's default)
MODERNBERT_ATTENTION_SEQLENS = (512, 8192)
MODERNBERT_POSITIONS = (("rotary", dict(rotary_base=160_000.0)),
                        ("rotary,window=64", dict(rotary_base=10_000.0, window=64)))


@dataclass(frozen=True)
class CompileCase:
    launcher: str  # "<kernels file>.<host function>", e.g. "attention.attention_bwd"
    variant: str  # what the call varies beyond the shape, e.g. "dropout_p=0.1"
    shape: dict
    dtype: str  # one of DTYPES
    call: Callable[[], None] = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        shape = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.launcher}[{self.variant}]/{shape}/{self.dtype}"

    def run(self) -> None:
        """Call the launcher, with TF32 allowed for fp32 dots exactly when the dtype says so."""
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if self.dtype.endswith("+tf32") else "highest")
        try:
            self.call()
        finally:
            torch.set_float32_matmul_precision(precision)


def _kernels(module: str):
    return importlib.import_module(f"fastbert.kernels.{module}")


def _implementation(op):
    """The Python body of a torch.library custom op: called directly, because a custom op called on meta
    tensors runs its fake (shape-only) registration instead."""
    return getattr(op, "_init_fn", op)


def _meta(*shape: int, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass(frozen=True)
class Batch:
    model: Model
    layout: str
    seqlen: int
    dtype: torch.dtype

    @property
    def batch(self) -> int:
        return TOKEN_SLOTS // self.seqlen

    @functools.cached_property
    def lengths(self) -> list[int]:
        return random_lengths(self.batch, self.seqlen, torch.Generator().manual_seed(1)).tolist()

    @property
    def rows(self) -> int:
        """Rows of the token-wise launchers: every slot of a padded batch, the real tokens of a packed one."""
        return self.batch * self.seqlen if self.layout == "padded" else sum(self.lengths)

    @property
    def labelled(self) -> int:
        """Labelled tokens (the MLM loss's rows): a share of the real tokens, in either layout."""
        return round(MLM_LABELLED * sum(self.lengths))

    def shape(self) -> dict:
        return {"model": self.model.name, "layout": self.layout, "seqlen": self.seqlen, "batch": self.batch,
                "rows": self.rows}

    def hidden_states(self, features: int) -> torch.Tensor:
        """[B, S, features] padded, [T, features] packed."""
        lead = (self.batch, self.seqlen) if self.layout == "padded" else (self.rows,)
        return _meta(*lead, features, dtype=self.dtype)

    def heads_layout(self) -> torch.Tensor:
        """One of q, k, v as the QKV projection and the attention hand them over: [B, heads, S, d] views of a
        [B, S, heads, d] buffer, or packed [T, heads, d]."""
        m = self.model
        head_dim = m.hidden // m.heads
        if self.layout == "varlen":
            return _meta(self.rows, m.heads, head_dim, dtype=self.dtype)
        return _meta(self.batch, self.seqlen, m.heads, head_dim, dtype=self.dtype).transpose(1, 2)

    def attention_inputs(self):
        """q, k, v (slices of the QKV projection's buffer), mask, cu_seqlens, max_seqlen."""
        m = self.model
        head_dim = m.hidden // m.heads
        if self.layout == "varlen":
            qkv = _meta(3, self.rows, m.heads, head_dim, dtype=self.dtype)
            cu_seqlens = _meta(self.batch + 1, dtype=torch.int32)
            return (*qkv.unbind(0), None, cu_seqlens, max(self.lengths))
        qkv = _meta(3, self.batch, m.heads, self.seqlen, head_dim, dtype=self.dtype)
        return (*qkv.unbind(0), _meta(self.batch, self.seqlen, dtype=torch.int64), None, self.seqlen)


def _seed(dropout_p: float):
    return _meta(1, dtype=torch.int64) if dropout_p > 0 else None


def _qkv_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    qkv = _kernels("qkv")
    m = b.model

    def forward():
        qkv.qkv_projection_fwd(b.hidden_states(m.hidden), _meta(3 * m.hidden, m.hidden, dtype=b.dtype),
                               _meta(3 * m.hidden, dtype=b.dtype), m.heads)

    def backward():
        grads = [b.heads_layout() for _ in range(3)]
        qkv.qkv_projection_bwd(*grads, b.hidden_states(m.hidden), _meta(3 * m.hidden, m.hidden, dtype=b.dtype))

    return [("qkv.qkv_projection_fwd", "-", forward), ("qkv.qkv_projection_bwd", "-", backward)]


def _relative_bias(b: Batch, with_bias: bool):
    """(relative_bias fp32 [buckets, heads], relative_buckets int32 [2D + 1]), or (None, None)."""
    if not with_bias:
        return None, None
    return (_meta(RELATIVE_BIAS_BUCKETS, b.model.heads, dtype=torch.float32),
            _meta(2 * RELATIVE_BIAS_MAX_DISTANCE + 1, dtype=torch.int32))


def _attention_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    attention = _kernels("attention")
    scale = (b.model.hidden // b.model.heads) ** -0.5
    cases = []
    biases = (False, True) if (b.model.name, b.seqlen) in RELATIVE_BIAS_BATCHES else (False,)
    for with_bias in biases:
        for p in (0.0, DROPOUT_P):
            def forward(p=p, with_bias=with_bias):
                q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
                _implementation(attention.attention_fwd)(q, k, v, mask, cu_seqlens, max_seqlen, _seed(p), p, scale,
                                                         *_relative_bias(b, with_bias))

            def backward(p=p, with_bias=with_bias):
                q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
                lse = (_meta(b.model.heads, b.rows, dtype=torch.float32) if b.layout == "varlen"
                       else _meta(b.batch, b.model.heads, b.seqlen, dtype=torch.float32))
                _implementation(attention.attention_bwd)(b.heads_layout(), q, k, v, b.heads_layout(), lse, mask,
                                                         cu_seqlens, max_seqlen, _seed(p), p, scale,
                                                         *_relative_bias(b, with_bias))

            def inference(p=p, with_bias=with_bias):  # no log-sum-exp stored (dropout: frozen inputs in training)
                q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
                _implementation(attention.attention_infer)(q, k, v, mask, cu_seqlens, max_seqlen, _seed(p), p,
                                                           scale, *_relative_bias(b, with_bias))

            variant = ("relative_bias," if with_bias else "") + f"dropout_p={p}"
            cases += [("attention.attention_fwd", variant, forward), ("attention.attention_infer", variant, inference),
                      ("attention.attention_bwd", variant, backward)]
    return cases


def _layer_norm_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    layer_norm = _kernels("layer_norm")
    hidden = b.model.hidden
    cases = []
    # the sublayer outputs in training, the same at inference, the MLM transform, and under autocast the
    # embeddings (an fp32 sum of fp32 tables in, the 16-bit dtype out)
    variants = [(True, DROPOUT_P, b.dtype), (True, 0.0, b.dtype), (False, 0.0, b.dtype)]
    if b.dtype != torch.float32:
        variants.append((False, 0.0, torch.float32))
    for residual, p, x_dtype in variants:
        def tensors(residual=residual, x_dtype=x_dtype):
            x = _meta(b.rows, hidden, dtype=x_dtype)
            return x, _meta(hidden, dtype=b.dtype), _meta(b.rows, hidden, dtype=x_dtype) if residual else None

        def forward(save, p=p, tensors=tensors):
            x, weight, residual = tensors()
            _implementation(layer_norm.layer_norm_fwd)(x, weight, weight, residual, _seed(p), LAYER_NORM_EPS, p,
                                                       b.dtype, save == "output")

        def backward(save, p=p, tensors=tensors):
            x, weight, residual = tensors()
            y = _meta(b.rows, hidden, dtype=b.dtype)
            stats = _meta(b.rows, layer_norm.stats_width(save == "output"), dtype=torch.float32)
            inputs = (None, None, y) if save == "output" else (x, residual, None)
            _implementation(layer_norm.layer_norm_bwd)(y, *inputs, stats, weight, weight, _seed(p), p, x.dtype,
                                                       residual is not None)

        def inference(p=p, tensors=tensors):
            x, weight, residual = tensors()
            _implementation(layer_norm.layer_norm_infer)(x, weight, weight, residual, _seed(p), LAYER_NORM_EPS, p,
                                                         b.dtype, False)

        variant = f"residual={residual},dropout_p={p}" + (",x=float32" if x_dtype != b.dtype else "")
        for save in layer_norm.SAVE_CHOICES:
            cases += [("layer_norm.layer_norm_fwd", f"{variant},save={save}", functools.partial(forward, save)),
                      ("layer_norm.layer_norm_bwd", f"{variant},save={save}", functools.partial(backward, save))]
        if p == 0.0:  # inference: no statistics, no side buffer
            cases.append(("layer_norm.layer_norm_infer", variant, inference))
    return cases


def _dropout_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    """The embeddings' dropout (the heads' run the same kernel on [B, H] or [B, S, H]; the backward is the
    same launcher on dy)."""
    dropout = _kernels("dropout")

    def forward():
        _implementation(dropout.dropout_fwd)(b.hidden_states(b.model.hidden), _seed(DROPOUT_P), DROPOUT_P)

    return [("dropout.dropout_fwd", f"p={DROPOUT_P}", forward)]


def _linear_bias_gelu(rows: int, features: int, dtype, model: Model, approximate: str) -> None:
    bias_gelu = _kernels("bias_gelu")
    _implementation(bias_gelu._linear_bias_gelu_op)(
        _meta(rows, model.hidden, dtype=dtype), _meta(features, model.hidden, dtype=dtype),
        _meta(features, dtype=dtype), approximate)


def _ffn_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    bias_gelu = _kernels("bias_gelu")
    m = b.model
    cases = []
    for approximate in GELU_APPROXIMATIONS:
        def tensor():
            return _meta(b.rows, m.intermediate, dtype=b.dtype)

        def epilogue(approximate=approximate):
            _linear_bias_gelu(b.rows, m.intermediate, b.dtype, m, approximate)

        def epilogue_backward(approximate=approximate, sum_columns=True):  # False: b1 frozen (LoRA, BitFit)
            bias_gelu.bias_gelu_bwd(tensor(), tensor(), None, approximate, sum_columns=sum_columns)

        def split(approximate=approximate):
            bias_gelu.bias_gelu_fwd(tensor(), _meta(m.intermediate, dtype=b.dtype), approximate)

        def split_backward(approximate=approximate, sum_columns=True):
            bias_gelu.bias_gelu_bwd(tensor(), tensor(), _meta(m.intermediate, dtype=b.dtype), approximate,
                                    sum_columns=sum_columns)

        def epilogue_without_pre(approximate=approximate):  # kernels/ffn.py when no backward reads h
            bias_gelu.linear_bias_gelu_fwd(_meta(b.rows, m.hidden, dtype=b.dtype),
                                           _meta(m.intermediate, m.hidden, dtype=b.dtype),
                                           _meta(m.intermediate, dtype=b.dtype), approximate, store_pre=False)

        def gelu_of_pre(approximate=approximate):  # kernels/ffn.py's backward: gelu(h) again, no bias
            bias_gelu.bias_gelu_fwd(tensor(), None, approximate)

        variant = f"approximate={approximate}"
        cases += [("bias_gelu.linear_bias_gelu", f"ffn,{variant}", epilogue),
                  ("bias_gelu.linear_bias_gelu", f"ffn without h,{variant}", epilogue_without_pre),
                  ("bias_gelu.bias_gelu_bwd", f"epilogue's,{variant}", epilogue_backward),
                  ("bias_gelu.bias_gelu_fwd", f"ffn backward's,{variant}", gelu_of_pre),
                  ("bias_gelu.bias_gelu_fwd", variant, split),
                  ("bias_gelu.bias_gelu_bwd", variant, split_backward),
                  ("bias_gelu.bias_gelu_bwd", f"epilogue's,frozen bias,{variant}",
                   functools.partial(epilogue_backward, sum_columns=False)),
                  ("bias_gelu.bias_gelu_bwd", f"frozen bias,{variant}", functools.partial(split_backward,
                                                                                          sum_columns=False))]
    return cases


def _mlm_cases(model: Model, rows: int, dtype) -> list[tuple[str, str, Callable]]:
    """The MLM head on its labelled rows: the transform's matmul + GELU, then the decoder's loss."""
    mlm_loss = _kernels("mlm_loss")

    def inputs():
        return (_meta(rows, model.hidden, dtype=dtype), _meta(model.vocab, model.hidden, dtype=dtype),
                _meta(model.vocab, dtype=dtype), _meta(rows, dtype=torch.int64))

    def forward():
        _implementation(mlm_loss.mlm_loss_fwd)(*inputs(), IGNORE_INDEX, "mean", 0.0)

    def inference():  # the merge kernel without softmax_stats
        _implementation(mlm_loss.mlm_loss_inference)(*inputs(), IGNORE_INDEX, "mean", 0.0)

    def backward():
        _implementation(mlm_loss.mlm_loss_bwd)(_meta(dtype=torch.float32), *inputs(),
                                               _meta(2 * rows + 1, dtype=torch.float32), IGNORE_INDEX, "mean", 0.0,
                                               (True, True, True))

    cases = [("bias_gelu.linear_bias_gelu", f"mlm transform,approximate={approximate}",
              lambda approximate=approximate: _linear_bias_gelu(rows, model.hidden, dtype, model, approximate))
             for approximate in GELU_APPROXIMATIONS]
    return cases + [("mlm_loss.mlm_loss_fwd", "-", forward), ("mlm_loss.mlm_loss_inference", "-", inference),
                    ("mlm_loss.mlm_loss_bwd", "-", backward)]


def _modernbert_cases(dtype) -> list[tuple[str, str, Callable]]:
    """ModernBERT-base's bias-less launcher calls (MODERNBERT): the gated epilogue matmul with and without h (and
    with the bias of an mlp_bias=True checkpoint), the GeGLU's elementwise backward kernels, the QKV projection without bias, and the LayerNorm without
    bias, with the residual stream out (save "output" and "input") and without a residual (the embeddings' and
    the final norm)."""
    bias_gelu, layer_norm, qkv = _kernels("bias_gelu"), _kernels("layer_norm"), _kernels("qkv")
    m, rows = MODERNBERT, MODERNBERT_ROWS

    def tokens(features):
        return _meta(rows, features, dtype=dtype)

    def geglu(store_pre, with_bias=False):  # mlp_bias=True checkpoints give the up-projection a bias
        bias = _meta(2 * m.intermediate, dtype=dtype) if with_bias else None
        bias_gelu.linear_bias_gelu_fwd(tokens(m.hidden), _meta(2 * m.intermediate, m.hidden, dtype=dtype), bias,
                                       "none", store_pre=store_pre, gated=True)

    def geglu_backward(with_bias):
        bias_gelu.geglu_bwd(tokens(m.intermediate), tokens(2 * m.intermediate), sum_columns=with_bias)

    def qkv_forward():
        qkv.qkv_projection_fwd(tokens(m.hidden), _meta(3 * m.hidden, m.hidden, dtype=dtype), None, m.heads)

    def qkv_backward():
        grads = [_meta(rows, m.heads, m.hidden // m.heads, dtype=dtype) for _ in range(3)]
        qkv.qkv_projection_bwd(*grads, tokens(m.hidden), _meta(3 * m.hidden, m.hidden, dtype=dtype),
                               needs=(True, True, False))

    cases = [("bias_gelu.linear_bias_gelu", "geglu,no bias", functools.partial(geglu, True)),
             ("bias_gelu.linear_bias_gelu", "geglu without h,no bias", functools.partial(geglu, False)),
             ("bias_gelu.linear_bias_gelu", "geglu,bias", functools.partial(geglu, True, True)),
             ("bias_gelu.linear_bias_gelu", "geglu without h,bias", functools.partial(geglu, False, True)),
             ("bias_gelu.geglu_fwd", "ffn backward's", lambda: bias_gelu.geglu_fwd(tokens(2 * m.intermediate))),
             ("bias_gelu.geglu_bwd", "no bias", functools.partial(geglu_backward, False)),
             ("bias_gelu.geglu_bwd", "bias", functools.partial(geglu_backward, True)),
             ("qkv.qkv_projection_fwd", "no bias", qkv_forward), ("qkv.qkv_projection_bwd", "no bias", qkv_backward)]
    for residual in (True, False):
        for save in layer_norm.SAVE_CHOICES:
            def forward(residual=residual, save=save):
                _implementation(layer_norm.layer_norm_fwd)(
                    tokens(m.hidden), _meta(m.hidden, dtype=dtype), None, tokens(m.hidden) if residual else None,
                    None, LAYER_NORM_EPS, 0.0, dtype, save == "output", residual)

            def backward(residual=residual, save=save):
                # with the stream out, save="input" reads the saved summed alone (x_is_sum)
                from_output = save == "output"
                y, x = (tokens(m.hidden), None) if from_output else (None, tokens(m.hidden))
                _implementation(layer_norm.layer_norm_bwd)(
                    tokens(m.hidden), x, None, y, _meta(rows, layer_norm.stats_width(from_output), dtype=torch.float32),
                    _meta(m.hidden, dtype=dtype), None, None, 0.0, dtype, residual,
                    tokens(m.hidden) if residual else None, residual and not from_output)

            variant = f"no bias,{'residual out' if residual else 'residual=False'},save={save}"
            cases += [("layer_norm.layer_norm_fwd", variant, forward), ("layer_norm.layer_norm_bwd", variant, backward)]

        def inference(residual=residual):
            _implementation(layer_norm.layer_norm_infer)(
                tokens(m.hidden), _meta(m.hidden, dtype=dtype), None, tokens(m.hidden) if residual else None,
                None, LAYER_NORM_EPS, 0.0, dtype, residual)

        cases.append(("layer_norm.layer_norm_infer", f"no bias,{'residual out' if residual else 'residual=False'}",
                      inference))
    return cases


def _modernbert_attention_cases(b: Batch) -> list[tuple[str, str, Callable]]:
    """ModernBERT-base's attention forward and backward with rotary positions, and with rotary positions and a
    window (MODERNBERT_POSITIONS), without dropout."""
    attention = _kernels("attention")
    scale = (b.model.hidden // b.model.heads) ** -0.5
    cases = []
    for variant, positions in MODERNBERT_POSITIONS:
        def forward(positions=positions):
            q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
            _implementation(attention.attention_fwd)(q, k, v, mask, cu_seqlens, max_seqlen, None, 0.0, scale,
                                                     **positions)

        def backward(positions=positions):
            q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
            lse = (_meta(b.model.heads, b.rows, dtype=torch.float32) if b.layout == "varlen"
                   else _meta(b.batch, b.model.heads, b.seqlen, dtype=torch.float32))
            _implementation(attention.attention_bwd)(b.heads_layout(), q, k, v, b.heads_layout(), lse, mask,
                                                     cu_seqlens, max_seqlen, None, 0.0, scale, **positions)

        def inference(positions=positions):
            q, k, v, mask, cu_seqlens, max_seqlen = b.attention_inputs()
            _implementation(attention.attention_infer)(q, k, v, mask, cu_seqlens, max_seqlen, None, 0.0, scale,
                                                       **positions)

        cases += [("attention.attention_fwd", variant, forward), ("attention.attention_bwd", variant, backward),
                  ("attention.attention_infer", variant, inference)]
    return cases


def cases(dtypes=DTYPES, models=MODELS) -> list[CompileCase]:
    """Every launcher call of the audit, for the given dtype names and models."""
    out = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name.removesuffix("+tf32"))
        for model in models:
            for seqlen in SEQLENS:
                for layout in LAYOUTS:
                    b = Batch(model, layout, seqlen, dtype)
                    for launcher, variant, call in (*_qkv_cases(b), *_attention_cases(b), *_layer_norm_cases(b),
                                                    *_dropout_cases(b), *_ffn_cases(b)):
                        out.append(CompileCase(launcher, variant, b.shape(), dtype_name, call))
                b = Batch(model, "padded", seqlen, dtype)
                shape = {"model": model.name, "seqlen": seqlen, "batch": b.batch, "rows": b.labelled}
                out += [CompileCase(launcher, variant, shape, dtype_name, call)
                        for launcher, variant, call in _mlm_cases(model, b.labelled, dtype)]
            for rows in FEW_LABELLED_ROWS:
                out += [CompileCase(launcher, variant, {"model": model.name, "rows": rows}, dtype_name, call)
                        for launcher, variant, call in _mlm_cases(model, rows, dtype)]
        if dtype_name in MODERNBERT_DTYPES:
            shape = {"model": MODERNBERT.name, "layout": "varlen", "rows": MODERNBERT_ROWS}
            out += [CompileCase(launcher, variant, shape, dtype_name, call)
                    for launcher, variant, call in _modernbert_cases(dtype)]
            for seqlen in MODERNBERT_ATTENTION_SEQLENS:
                for layout in LAYOUTS:
                    b = Batch(MODERNBERT, layout, seqlen, dtype)
                    out += [CompileCase(launcher, variant, b.shape(), dtype_name, call)
                            for launcher, variant, call in _modernbert_attention_cases(b)]
    return out
