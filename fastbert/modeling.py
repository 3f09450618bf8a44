"""BERT (Devlin et al., 2018) as nn.Modules with HF transformers' module tree, parameter names, forward
arguments and outputs. Every fused computation goes through `fastbert.ops`, which picks the Triton kernel
or the PyTorch reference (config.backend); nothing here launches a kernel or branches on a device.

Where transformers imports, the models are transformers `PreTrainedModel`s (fastbert.bases).

A Linear that a tool has replaced or hooked (PEFT LoRA, a quantizer's module swap, forward hooks) is
called as a module, never read through `.weight`: the fused path that reads weights is taken only for a
plain `nn.Linear` without hooks (`is_plain_linear`), the unfused path calls the module.

Shapes: B batch, S sequence length, H hidden size, T packed tokens, V vocabulary, K the MLM label
budget per sequence (config.max_predictions_per_seq).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastbert import hf, ops, outputs
from fastbert.bases import ModelBase
from fastbert.config import BertConfig
from fastbert.kernels.fused_op import eager_autograd
from fastbert.prefix import cache_argument, check_batch, prefix_keys
from fastbert.sublayer import attention_sublayer, feed_forward_sublayer
from fastbert.validation import (IGNORE_INDEX, PACKED_ARGUMENTS, HF_PACKED_ALIASES, check_label_budget, check_labels,
                                 check_model_inputs, check_on_device, check_packed_inputs, key_padding_mask,
                                 packed_arguments)


@dataclass
class AttentionLayout:
    """How the encoder's tokens are laid out: padded [B, S, H] with a key mask, or packed [T, H]."""
    attention_mask: torch.Tensor | None = None  # [B, S], padded layout
    cu_seqlens: torch.Tensor | None = None  # int32 [B+1], packed layout
    max_seqlen: int = 0  # >= the longest sequence (an upper bound is enough)
    # MPNet's relative-position bias: the table [buckets, heads] and the bucket of each key-minus-query
    # distance, int32 [2D+1] (ops.relative_position_buckets); None for the rest of the family
    relative_bias: torch.Tensor | None = None
    relative_buckets: torch.Tensor | None = None
    # prefix keys (transformers' cache, as PEFT's prefix tuning fills it, fastbert.prefix): every layer's (key, value)
    # [B, heads, P, d], attended before the tokens' own keys, with attention_mask [B, P + S]; None for none.
    # run_layers gives each layer its own pair as layer_prefix
    prefixes: tuple | None = None
    layer_prefix: tuple | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


# torch's global module hooks: dicts that registering a hook adds to and its handle removes from (never rebound)
_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
                 nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)


class Submodule:
    """A class attribute naming a child module: `self.name` then reads it from the module's `_modules` in one
    Python call. Without it the instance lookup fails first and nn.Module.__getattr__ runs after it (on Python
    3.11 once an AttributeError is built): a BERT layer reads 15 children a forward, and reading them here took
    a tenth of BERT-base's inference forward's host instructions away (benchmarks/host_instructions.py).
    Assigning and deleting stay nn.Module's, which write `_modules`, so a child replaced by a tool (PEFT,
    fastbert.apply, add_module) is what the next read returns; a child that is gone reads as nn.Module reads it."""
    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        try:
            return module._modules[self.name]
        except KeyError:  # not a child now: nn.Module.__getattr__ runs next, as without this attribute
            raise AttributeError(self.name) from None


def is_unhooked(module: nn.Module, cls: type) -> bool:
    """True for an instance of `cls` itself (not a subclass or a wrapper) with no hooks, module or global, and no
    forward of its own: only then may a fused op bypass its forward. Runs several times a layer: short-circuits,
    no tuple."""
    return type(module) is cls and not (any(_GLOBAL_HOOKS) or has_hooks(module))


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run more than its class's forward: hooks of its own, or a forward set on the
    instance (accelerate's hooks set one; removing them sets the class's back, bound). Global hooks are not
    counted: they run on any module, fastbert's too."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__ and has_own_forward(module))


def has_own_forward(module: nn.Module) -> bool:
    """Whether the instance holds a forward other than its class's."""
    forward = module.__dict__.get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(module).forward


def is_plain_linear(module: nn.Module) -> bool:
    """True for an nn.Linear itself with no hooks: only then may a fused op read its weight instead of
    calling it."""
    return is_unhooked(module, nn.Linear)


def is_plain_norm(module: nn.Module) -> bool:
    """True for an nn.LayerNorm itself with no hooks: only then may a fused op read its weight and bias instead of
    calling it. A hooked, wrapped or subclassed norm (PEFT's LN tuning wraps it) is called, as transformers calls
    it."""
    return is_unhooked(module, nn.LayerNorm)


def weight_and_bias(module: nn.Module) -> tuple:
    """module's weight and bias (either may be None), read from its parameter dict. `module.weight` first fails
    the instance lookup, then runs nn.Module.__getattr__ (on Python 3.11 after building an AttributeError):
    about 0.8 us a read, which the fused paths pay for every parameter of every layer. A module that no longer
    holds them there (a reparametrisation that deleted them) is read as an attribute."""
    held = module._parameters
    if "weight" in held and "bias" in held:
        return held["weight"], held["bias"]
    return module.weight, module.bias


def biased_linear_parameters(modules) -> list | None:
    """[(weight, bias)] of `modules` where each is a plain Linear (is_plain_linear) with a bias, the case a fused
    op reads in place of calling them; None otherwise (the caller then calls the modules)."""
    parameters = []
    for module in modules:  # a loop, not a generator: it runs several times a layer
        if not is_plain_linear(module):
            return None
        weight, bias = weight_and_bias(module)
        if bias is None:
            return None
        parameters.append((weight, bias))
    return parameters


def dropout_rate(dropout: nn.Module) -> float | None:
    """The rate a fused op applies in place of the module `dropout`, read at each forward as transformers'
    modules read theirs: an nn.Dropout's p in training mode, 0 in eval mode; 0 for nn.Identity (transformers'
    ModernBERT without dropout). None for anything else (a subclass, a wrapper, a hooked module): the caller
    then calls the module."""
    if is_unhooked(dropout, nn.Dropout):
        return dropout.p if dropout.training else 0.0
    return 0.0 if is_unhooked(dropout, nn.Identity) else None


def run_dropout(dropout: nn.Module, hidden, config: BertConfig):
    """dropout(hidden) through ops.dropout (no mask kept on the Triton path) at dropout_rate's rate; a module
    it cannot read is called."""
    rate = dropout_rate(dropout)
    return dropout(hidden) if rate is None else ops.dropout(hidden, rate, backend=config.backend)


def layer_norm(config: BertConfig, norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """norm(hidden): fastbert's fused op on a plain LayerNorm's parameters (is_plain_norm; no bias where it has
    none), any other module called."""
    if is_plain_norm(norm):
        return ops.layer_norm(hidden, *weight_and_bias(norm), config.layer_norm_eps, backend=config.backend,
                              save=config.layer_norm_backward)
    return norm(hidden)


def linear(dense: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """dense(hidden): F.linear on the parameters of a plain Linear (is_plain_linear), as its forward computes it,
    without nn.Module.__call__ and the forward's two reads through nn.Module.__getattr__; any other module is
    called."""
    if is_plain_linear(dense):
        return F.linear(hidden, *weight_and_bias(dense))
    return dense(hidden)


def _gelu_linear(dense: nn.Module, hidden: torch.Tensor, config: BertConfig, approximate: str | None = None):
    """gelu(dense(hidden)): fused with the matmul for a plain Linear, else after calling the module.
    approximate: GELU's form, config.gelu_approximate unless given."""
    approximate = config.gelu_approximate if approximate is None else approximate
    parameters = biased_linear_parameters((dense,))
    if parameters is not None:
        return ops.linear_bias_gelu(hidden, *parameters[0], approximate, backend=config.backend)
    return F.gelu(dense(hidden), approximate=approximate)


class BertEmbeddings(nn.Module):
    """word + position (+ token type) embeddings, LayerNorm, dropout; the family's differences are config
    switches: no token type table where type_vocab_size is 0 (DistilBERT, MPNet), positions counted from the
    padding index (RoBERTa, MPNet: config.positions_from_padding), tables of config.embedding_width (ELECTRA)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        width = config.embedding_width
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.padding_index)
        position_padding = config.padding_index if config.positions_from_padding else None
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width, padding_idx=position_padding)
        if config.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def default_position_ids(self, input_ids, seqlen: int, device, cache_length: int = 0) -> torch.Tensor:
        """[B or 1, S]: 0..S-1, or for positions from the padding index, as transformers' RoBERTa counts them:
        padding_index + 1 onwards over the real tokens, padding_index on padding tokens (config.padding_index:
        pad_token_id, or MPNet's fixed 1). After cache_length prefix keys, the tokens' positions start that much
        later, as transformers counts them (not RoBERTa's from inputs_embeds: transformers does not offset those)."""
        if not self.config.positions_from_padding:
            return torch.arange(cache_length, cache_length + seqlen, device=device)[None, :]
        pad = self.config.padding_index
        if input_ids is None:  # inputs_embeds: no padding can be seen, every position is a token
            return torch.arange(pad + 1, seqlen + pad + 1, device=device)[None, :]
        real = input_ids.ne(pad).int()
        counted = torch.cumsum(real, dim=1).type_as(real)
        if cache_length:
            counted = counted + cache_length
        return (counted * real).long() + pad

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                cache_length: int = 0):
        embeds = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, E]
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, embeds.shape[1], embeds.device, cache_length)
        embeds = embeds + self.position_embeddings(position_ids)
        if self.config.type_vocab_size:
            if token_type_ids is None:  # segment 0 everywhere, broadcast over the batch
                token_type_ids = torch.zeros_like(position_ids[:1])
            embeds = embeds + self.token_type_embeddings(token_type_ids)
        return run_dropout(self.dropout, layer_norm(self.config, self.LayerNorm, embeds), self.config)


class SelfAttention(nn.Module):
    """Multi-head self-attention (the one implementation of the family): the context of every token,
    before the output projection. Subclasses hold the query, key and value Linears under their
    architecture's names and return them from `linears`, and say in `probs_dropout` at what rate the
    attention probabilities drop. When all three are plain Linears, one fused projection reads their
    concatenated weights; otherwise each module is called."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        raise NotImplementedError

    def probs_dropout(self) -> float:
        """The dropout rate of the attention probabilities now: transformers' attention reads its Dropout's p
        at each forward, in its own training mode."""
        return self.dropout.p if self.training else 0.0

    def attention_options(self) -> dict:
        """The architecture's extra keywords of ops.attention (ModernBERT: rotary_base, window)."""
        return {}

    def project(self, hidden):
        """q, k, v each [B, heads, S, d] (padded hidden [B, S, H]) or [T, heads, d] (packed [T, H])."""
        config, backend = self.config, self.config.backend
        linears = self.linears()
        parameters = biased_linear_parameters(linears)
        # PyTorch's path without a backward, on a CPU, runs one GEMM a Linear (below): concatenating the weights for
        # one GEMM would copy them (7 MB a layer of fp32 BERT-base) on every forward. On a GPU the copy is a few
        # microseconds of the GPU's time, and the host is what an inference forward waits for. The third H100 run
        # profiled this form (benchmarks/gpu-runs/2026-11-27-h100-session3/profile-bert-base.txt; its graph rows ran
        # it too): per call, under torch.profiler, aten::linear took the host 71.9 us and aten::cat 26.2 us, so
        # two cats and one GEMM should take it less than three GEMMs would (inferred: the three were never timed
        # on a GPU)
        split = (parameters is not None and not torch.is_grad_enabled() and backend != "triton"
                 and not (hidden.is_cuda or ops.auto_as_gpu(hidden))
                 and ops.resolve_backend(backend, hidden, *parameters[0], op="qkv_projection") == "torch")
        if parameters is not None and not split:
            weight = torch.cat([weight for weight, _ in parameters])  # [3H, H]
            bias = torch.cat([bias for _, bias in parameters])
            return ops.qkv_projection(hidden, weight, bias, config.num_attention_heads, backend=backend)
        # one GEMM a Linear, as transformers' BERT runs them
        heads = (*hidden.shape[:-1], config.num_attention_heads, config.head_dim)
        if parameters is None:
            projected = [m(hidden).view(*heads) for m in linears]  # sizes one by one (below)
        else:
            projected = [F.linear(hidden, weight, bias).view(*heads) for weight, bias in parameters]
        return projected if hidden.dim() == 2 else [t.transpose(1, 2) for t in projected]

    def sublayer(self, hidden, layout: AttentionLayout, dense: nn.Module, norm: nn.Module,
                 dropout: nn.Module | None, pre_norm: nn.Module | None = None, return_residual: bool = False):
        """norm(dropout(dense(self(x))) + hidden), the whole attention sublayer, as one autograd node
        (fastbert/sublayer.py), with x = hidden (post-LN) or pre_norm(hidden) (pre-LN; return_residual: the output
        is (normed, summed stream), as ops.layer_norm's); or None where that would not run the ops that calling them
        one by one runs: an attention or LayerNorm whose resolved path is not its Triton one, a module it would
        bypass that is not plain, or no gradient wanted. The QKV projection may resolve to any path:
        PyTorch's runs in its cuBLAS form there (fastbert/sublayer.py's header). dropout: the sublayer's Dropout
        module, or None for none. The caller checks one_node_sublayers(), that the modules it calls one by one are
        not hooked and that no attention probabilities are wanted."""
        config = self.config
        backend = config.backend
        linears = self.linears()
        hidden_p = 0.0 if dropout is None else dropout_rate(dropout)
        if layout.layer_prefix is not None:
            return None  # prefix keys: the reference's attention, called by forward
        if not is_plain_norm(norm) or not (pre_norm is None or is_plain_norm(pre_norm)):
            return None  # a norm to call
        norm_weight, norm_bias = weight_and_bias(norm)
        requires_grad = (hidden.requires_grad or norm_weight.requires_grad
                         or (norm_bias is not None and norm_bias.requires_grad))
        parameters = []  # (weight, bias) of the QKV Linears, dense, norm and pre_norm: the node's inputs
        for m in (*linears, dense):  # a loop, not all(generator): this runs on every layer's forward
            if not is_plain_linear(m):
                return None
            weight, bias = weight_and_bias(m)
            # three Linears fuse with their biases concatenated (project); one (ModernBERT's Wqkv) and dense need none
            if bias is None and m is not dense and len(linears) != 1:
                return None
            requires_grad = requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            parameters.append((weight, bias))
        parameters.append((norm_weight, norm_bias))
        pre_weight, pre_bias = (None, None) if pre_norm is None else weight_and_bias(pre_norm)
        parameters.append((pre_weight, pre_bias))
        # the QKV projection's path as the per-op call resolves it: its input x = pre_norm(hidden) wants a gradient
        # where hidden or pre_norm's parameters do, its weight (concatenated) where any Linear's does (the direction)
        projected = [hidden]  # then the weights (paths.choose keys its cache on the second tensor's shape)
        for weight, bias in parameters[:len(linears)]:
            projected += (weight, bias)
        projection = ops.resolve_backend(backend, *projected, pre_weight, pre_bias, op="qkv_projection")
        if projection == "torch" and not ops._any_autocast():
            for t in projected:  # PyTorch's linear refuses mixed dtypes, where the node's form would cast them
                if t is not None and t.dtype != hidden.dtype:
                    return None
        if pre_weight is not None:
            requires_grad = (requires_grad or pre_weight.requires_grad
                             or (pre_bias is not None and pre_bias.requires_grad))
        relative_bias, relative_buckets = layout.relative_bias, layout.relative_buckets  # MPNet's table, or None
        if relative_bias is not None:
            ops.check_relative_bias(relative_bias, relative_buckets, config.num_attention_heads, hidden.device)
            requires_grad = requires_grad or relative_bias.requires_grad
        if hidden_p is None or not requires_grad:
            return None  # a dropout module to call, or no backward (the ops' inference calls)
        heads = config.num_attention_heads
        rotary_base = window = None
        options = self.attention_options()  # ModernBERT's rotary positions and window
        if options:
            rotary_base, window = options["rotary_base"], options["window"]
            ops.check_rotary_window(rotary_base, window, config.head_dim)  # as ops.attention checks them
        # "auto" reads fastbert.paths' table for plain attention, by q's shape: a stand-in of it ("triton" reads none)
        plain = (backend != "triton" and layout.attention_mask is None and not layout.packed and not options
                 and relative_bias is None)
        q_like = hidden.reshape(*hidden.shape[:2], heads, config.head_dim).transpose(1, 2) if plain else hidden
        norm_weights = (norm_weight,) if pre_norm is None else (norm_weight, pre_weight)
        if (ops.resolve_backend(backend, q_like, op="attention" if plain else None,
                                kernel_fits=config.head_dim in ops.ATTENTION_HEAD_DIMS) != "triton"
                or ops.resolve_backend(backend, hidden, *norm_weights, op="layer_norm") != "triton"):
            return None
        return attention_sublayer(hidden, parameters, relative_bias, (
            layout.attention_mask, layout.cu_seqlens, layout.max_seqlen, heads, self.probs_dropout(), rotary_base,
            window, relative_buckets, hidden_p, config.layer_norm_eps, config.layer_norm_backward == "output",
            return_residual, projection != "triton"))

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        config = self.config
        dropout_p = self.probs_dropout()
        q, k, v = self.project(hidden)
        backend = config.backend
        if layout.layer_prefix is not None:  # this layer's prefix keys first: k, v [B, heads, P + S, d]
            prefix_key, prefix_value = layout.layer_prefix
            k = torch.cat([prefix_key.to(k.dtype), k], dim=2)
            v = torch.cat([prefix_value.to(v.dtype), v], dim=2)
            # the attention kernel takes as many keys as queries: PyTorch's path on every backend, as for
            # output_attentions (the other ops keep theirs)
            backend = "torch"
        probs = None
        bias = {} if layout.relative_bias is None else dict(relative_bias=layout.relative_bias,
                                                            relative_buckets=layout.relative_buckets)
        bias.update(self.attention_options())
        if output_attentions:  # the probabilities are wanted: [B, heads, S, S] is materialised
            context, probs = ops.attention_with_probs(q, k, v, layout.attention_mask, dropout_p, **bias)
        elif layout.packed:
            context = ops.attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout_p,
                                           backend=config.backend, **bias)  # [T, heads, d]
        else:
            context = ops.attention(q, k, v, layout.attention_mask, dropout_p, backend=backend, **bias)
        # sizes one by one: PyTorch's argument parser takes longer over a torch.Size
        if layout.packed:
            context = context.reshape(*hidden.shape)  # [T, H]
        else:
            context = context.transpose(1, 2).reshape(*hidden.shape)  # [B, heads, S, d] -> [B, S, H]
        return context, probs


class BertSelfAttention(SelfAttention):
    """BERT's names: query, key, value (the output projection is BertSelfOutput's)."""
    query, key, value, dropout = Submodule(), Submodule(), Submodule(), Submodule()

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        # transformers' attributes, which head-pruning scripts and attention visualisers read (fastbert reads config)
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.head_dim
        self.all_head_size = config.num_attention_heads * config.head_dim
        self.scaling = config.head_dim ** -0.5

    def linears(self):
        return self.query, self.key, self.value


def add_and_norm(config: BertConfig, norm: nn.Module, projected, residual, dropout: nn.Module | None,
                 return_residual: bool = False):
    """norm(dropout(projected) + residual), one fused op: a sublayer's output after its projection. dropout:
    the sublayer's Dropout module (its rate read now, dropout_rate), or None for no dropout. return_residual:
    (normed, summed), as ops.layer_norm's. A norm that is not plain (is_plain_norm) is called on the sum."""
    if not is_plain_norm(norm):  # the modules called one by one, as transformers' forward calls them
        summed = (projected if dropout is None else dropout(projected)) + residual
        # the stream returned is not the tensor the norm's hooks saw: ModernBERT's MLP adds onto it in place
        return (norm(summed), summed.clone()) if return_residual else norm(summed)
    rate = 0.0 if dropout is None else dropout_rate(dropout)
    if rate is None:  # a module fastbert cannot read: called, then no dropout in the fused op
        projected, rate = dropout(projected), 0.0
    return ops.layer_norm(projected, *weight_and_bias(norm), config.layer_norm_eps, residual=residual,
                          dropout_p=rate, backend=config.backend, save=config.layer_norm_backward,
                          return_residual=return_residual)


class BertSelfOutput(nn.Module):
    dense, LayerNorm, dropout = Submodule(), Submodule(), Submodule()

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden, residual):
        return self.add_and_norm(linear(self.dense, hidden), residual)

    def add_and_norm(self, projected, residual):
        """LayerNorm(dropout(projected) + residual): the sublayer's output after its projection."""
        return add_and_norm(self.config, self.LayerNorm, projected, residual, self.dropout)


class BertAttention(nn.Module):
    self, output = Submodule(), Submodule()

    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False):
        attention, output = self.self, self.output
        if (not output_attentions and torch.is_grad_enabled() and one_node_sublayers(attention.config, hidden)
                and is_unhooked(attention, BertSelfAttention) and is_unhooked(output, BertSelfOutput)):
            normed = attention.sublayer(hidden, layout, output.dense, output.LayerNorm, output.dropout)
            if normed is not None:
                return normed, None
        context, probs = attention(hidden, layout, output_attentions)
        return output(context, hidden), probs


class BertIntermediate(nn.Module):
    dense = Submodule()

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden):
        return _gelu_linear(self.dense, hidden, self.config)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)


def _recompute(function, *args):
    """function(*args) keeping only its inputs for the backward, rerun there (non-reentrant checkpoint).
    Dropout masks come from seeds drawn from torch's RNG, which checkpoint restores, so the rerun
    draws the same masks and the gradients are those of the stored run."""
    return checkpoint(function, *args, use_reentrant=False)


def fused_feed_forward(config: BertConfig, up: nn.Module, down: nn.Module, attended, recompute: bool):
    """down(gelu(up(attended))) as one fused op that keeps the pre-activation but not the GELU output for the
    backward (with recompute, only `attended`: it reruns the up-projection); None where `up` and `down` are
    not plain Linears with biases (the caller then calls its modules)."""
    parameters = biased_linear_parameters((up, down))
    if parameters is None:
        return None
    (up_weight, up_bias), (down_weight, down_bias) = parameters
    return ops.feed_forward(attended, up_weight, up_bias, down_weight, down_bias, config.gelu_approximate,
                            recompute_pre=recompute, backend=config.backend)


def one_node_sublayers(config: BertConfig, hidden) -> bool:
    """Whether a sublayer may now run as one autograd node (fastbert/sublayer.py), before its modules and paths are
    read: eager autograd (eager_autograd) with a backend that can resolve to the Triton path ("triton", or "auto" on
    a CUDA tensor or one standing for a GPU's: ops.auto_as_gpu). "auto" on CPU tensors runs PyTorch's ops: learning
    that from resolve_backend would cost each layer of a CPU user's step some 30 Python calls. The callers ask
    torch.is_grad_enabled() first, inline: an inference forward then makes no Python call for it."""
    backend = config.backend
    return (hidden.is_cuda or backend == "triton" or (backend != "torch" and ops.auto_as_gpu(hidden))) and (
        eager_autograd())


def fused_feed_forward_sublayer(config: BertConfig, up: nn.Module, down: nn.Module, norm: nn.Module,
                                dropout: nn.Module, attended, recompute: bool):
    """norm(dropout(down(gelu(up(attended)))) + attended), the whole FFN sublayer, as one autograd node
    (fastbert/sublayer.py), or None where that would not run what fused_feed_forward and add_and_norm run: Linears
    that are not plain with biases, a norm that is not plain (is_plain_norm), a dropout module to call, an op whose
    resolved path is not a Triton one, or no gradient wanted. The caller checks one_node_sublayers() and that the
    modules it bypasses are not hooked."""
    parameters = biased_linear_parameters((up, down))
    if parameters is None or not is_plain_norm(norm):
        return None
    (up_weight, up_bias), (down_weight, down_bias) = parameters
    backend = config.backend
    path = ops.resolve_backend(backend, attended, up_weight, up_bias, down_weight, down_bias, op="feed_forward")
    hidden_p = dropout_rate(dropout)
    if path == "torch" or hidden_p is None:
        return None
    # what the FFN's backward reads h for (kernels/ffn.py's feed_forward): a gradient through it
    through_pre = (attended.requires_grad or up_weight.requires_grad or up_bias.requires_grad
                   or down_weight.requires_grad)
    norm_weight, norm_bias = weight_and_bias(norm)
    if not (through_pre or down_bias.requires_grad or norm_weight.requires_grad
            or (norm_bias is not None and norm_bias.requires_grad)):
        return None  # no backward: the ops' inference calls
    if ops.resolve_backend(backend, attended, norm_weight, op="layer_norm") != "triton":
        return None
    return feed_forward_sublayer(attended, (*parameters, (norm_weight, norm_bias)), config.gelu_approximate,
                                 through_pre and not recompute,
                                 "epilogue" if path == "triton" else path, hidden_p, config.layer_norm_eps,
                                 config.layer_norm_backward == "output")


class EncoderLayer(nn.Module):
    """One post-LayerNorm Transformer layer, the family's one implementation: subclasses name the modules
    and give `attention_block` (self-attention, its projection, residual and LayerNorm) and `feed_forward`."""

    def forward(self, hidden, layout: AttentionLayout, output_attentions: bool = False,
                checkpointing: str = "none"):
        """checkpointing "attention" or "ffn" recomputes that block in the backward (BertEncoder passes
        config.activation_checkpointing while training; "full" checkpoints the whole layer there)."""
        if checkpointing == "attention":
            attended, probs = _recompute(self.attention_block, hidden, layout, output_attentions)
        else:
            attended, probs = self.attention_block(hidden, layout, output_attentions)
        return self.feed_forward(attended, recompute=checkpointing == "ffn"), probs

    def attention_block(self, hidden, layout: AttentionLayout, output_attentions: bool):
        raise NotImplementedError

    def feed_forward(self, attended, recompute: bool = False):
        raise NotImplementedError


class BertLayer(EncoderLayer):
    attention, intermediate, output = Submodule(), Submodule(), Submodule()

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def attention_block(self, hidden, layout: AttentionLayout, output_attentions: bool):
        return self.attention(hidden, layout, output_attentions)

    def feed_forward(self, attended, recompute: bool = False):
        """BertOutput(BertIntermediate(attended), attended): [B, S, H] (packed: [T, H]) to the same shape;
        fused where neither module has hooks (fused_feed_forward), otherwise the modules are called."""
        intermediate, output = self.intermediate, self.output
        if is_unhooked(intermediate, BertIntermediate) and is_unhooked(output, BertOutput):
            if torch.is_grad_enabled() and one_node_sublayers(self.config, attended):
                normed = fused_feed_forward_sublayer(self.config, intermediate.dense, output.dense, output.LayerNorm,
                                                     output.dropout, attended, recompute)
                if normed is not None:
                    return normed
            projected = fused_feed_forward(self.config, intermediate.dense, output.dense, attended, recompute)
            if projected is not None:
                return output.add_and_norm(projected, attended)
        if recompute:
            return _recompute(lambda a: output(intermediate(a), a), attended)
        return output(intermediate(attended), attended)


class BertEncoder(nn.Module):
    layer_class = BertLayer  # the architecture's layer (its module names)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        # "full" activation checkpointing, whatever config.activation_checkpointing says, when set by
        # gradient_checkpointing_enable (transformers' or fastbert.bases'), with the checkpoint
        # function it was given; non-reentrant torch.utils.checkpoint when none was; of every
        # checkpointed_every-th layer (set_gradient_checkpointing)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None
        self.checkpointed_every = 1

    def forward(self, hidden, layout: AttentionLayout, output_hidden_states=False, output_attentions=False):
        return run_layers(self, self.layer, hidden, layout, output_hidden_states, output_attentions)


def run_layers(owner: nn.Module, layers, hidden, layout: AttentionLayout, output_hidden_states=False,
               output_attentions=False):
    """Run the encoder layers: (last hidden state, hidden states or None, attention probabilities or None).
    output_hidden_states is a flag or transformers' index / indices: unselected hidden states come back as
    None. `owner` holds the checkpointing switches (gradient_checkpointing, _gradient_checkpointing_func)
    and the config (BertEncoder, or a model whose layers are its own ModuleList: ModernBERT)."""
    check_layout(owner, layout)
    kept = selected_hidden_states(output_hidden_states, len(layers) + 1) if output_hidden_states else None
    all_hidden = [hidden if kept is None or 0 in kept else None] if output_hidden_states else None
    all_probs = [] if output_attentions else None
    recompute = owner._gradient_checkpointing_func or _recompute
    checkpointing = "full" if owner.gradient_checkpointing else owner.config.activation_checkpointing
    if not (owner.training and torch.is_grad_enabled()):
        checkpointing = "none"  # no backward: nothing to keep
    # under "full", the layers between every checkpointed_every-th one run as config.activation_checkpointing says
    # (selective checkpointing, or none)
    every, others = owner.checkpointed_every, checkpointing
    if checkpointing == "full":
        others = owner.config.activation_checkpointing if owner.config.activation_checkpointing != "full" else "none"
    for index, layer in enumerate(layers):
        try:
            if checkpointing == "full" and index % every == 0:
                # Layer inputs are kept, activations recomputed in the backward (see _recompute on dropout).
                if layout.prefixes is None:
                    hidden, probs = recompute(layer, hidden, layout, output_attentions)
                else:  # the prefix keys as tensor arguments: a reentrant checkpoint gives gradients to those only
                    hidden, probs = recompute(_run_prefixed, layer, hidden, layout, output_attentions,
                                              *layout.prefixes[index])
            elif layout.prefixes is None:
                hidden, probs = layer(hidden, layout, output_attentions, others)
            else:
                hidden, probs = _run_prefixed(layer, hidden, layout, output_attentions, *layout.prefixes[index],
                                              checkpointing=others)
        except TypeError as exc:  # a layer that takes other arguments (transformers' BertLayer put in the list)
            if any(isinstance(module, EncoderLayer) for module in layer.modules()):
                raise  # raised inside fastbert's layer, or a wrapper of one (torch.compile's, a checkpoint wrapper)
            raise TypeError(f"encoder layer {list(layers).index(layer)} is a {type(layer).__name__}, which fastbert's "
                            f"encoder cannot call: it calls its layers as (hidden, layout, output_attentions, "
                            f"checkpointing); put fastbert's {getattr(owner, 'layer_class', EncoderLayer).__name__} "
                            "there") from exc
        if output_hidden_states:
            all_hidden.append(hidden if kept is None or len(all_hidden) in kept else None)
        if output_attentions:
            all_probs.append(probs)
    return hidden, all_hidden, all_probs


def _run_prefixed(layer, hidden, layout: AttentionLayout, output_attentions, key, value, checkpointing="none"):
    """layer(...) attending to its prefix keys (key, value) first."""
    return layer(hidden, dataclasses.replace(layout, layer_prefix=(key, value)), output_attentions, checkpointing)


def set_gradient_checkpointing(model: nn.Module, transformers_setter, enable: bool, function,
                               every_n_layers: int) -> None:
    """`model`'s _set_gradient_checkpointing: transformers' (`transformers_setter`, or the stand-in's), then its
    every_n_layers for fastbert's encoders in `model`, whose 1st, (n+1)-th, ... layers are checkpointed:
    transformers counts only its own layer class (GradientCheckpointingLayer) and sets each fastbert encoder's one
    flag, which alone checkpoints every layer. A bad every_n_layers is a ValueError before anything is set."""
    if isinstance(every_n_layers, bool) or not hasattr(every_n_layers, "__index__") or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be an int >= 1, got {every_n_layers!r}")
    every_n_layers = operator.index(every_n_layers)  # a NumPy integer, as transformers takes it
    transformers_setter(enable, function, every_n_layers)
    for module in model.modules():
        if hasattr(module, "checkpointed_every"):
            module.checkpointed_every = every_n_layers


def check_layout(encoder: nn.Module, layout) -> None:
    """TypeError unless `layout` is fastbert's AttentionLayout: code written for transformers' encoder calls it
    as encoder(hidden_states, attention_mask), which would fail deep in a layer (fastbert.apply puts fastbert's
    encoder in a transformers model)."""
    if not isinstance(layout, AttentionLayout):
        raise TypeError(f"{type(encoder).__name__}.forward(hidden, layout, ...) takes fastbert's AttentionLayout as "
                        f"its second argument, got {type(layout).__name__}: fastbert's encoder (also in a "
                        "transformers model after fastbert.apply) is not called as transformers' "
                        "encoder(hidden_states, attention_mask); call the model with its attention_mask instead")


def selected_hidden_states(output_hidden_states, count: int) -> set[int] | None:
    """The indices (in [0, count)) of the hidden states that transformers' output_hidden_states keeps: None
    for a flag (all of them); an index or a sequence of indices, negative from the end, out of range selecting
    nothing (as transformers' output_capturing). TypeError for anything else."""
    if isinstance(output_hidden_states, bool):
        return None
    indices = [output_hidden_states] if isinstance(output_hidden_states, int) else output_hidden_states
    if not isinstance(indices, (list, tuple, range)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise TypeError(f"output_hidden_states must be a bool, a layer index or a list of them, "
                        f"got {output_hidden_states!r}")
    return {i % count for i in indices if -count <= i < count}


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output):
        return torch.tanh(linear(self.dense, sequence_output[:, 0]))  # [B, H] from the [CLS] token


class BertPreTrainedModel(ModelBase):
    """Weight init as transformers, HF checkpoint load / save (fastbert.hf does the file work), and the
    transformers methods fastbert implements itself so they behave the same with or without it."""

    config_class = BertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertEmbeddings", "BertLayer"]
    # the losses are means over their labels and ignore transformers' num_items_in_batch: Trainer must
    # divide by the gradient accumulation steps itself
    accepts_loss_kwargs = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint,
                                    every_n_layers: int = 1) -> None:
        set_gradient_checkpointing(self, super()._set_gradient_checkpointing, enable, gradient_checkpointing_func,
                                   every_n_layers)

    def _bert(self) -> "BertModel":
        """The encoder model: self, or the head model's child named base_model_prefix."""
        return self if isinstance(self, BertModel) else getattr(self, self.base_model_prefix)

    def get_input_embeddings(self) -> nn.Module:
        return self._bert().embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self._bert().embeddings.word_embeddings = value

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """A word embedding table of `new_num_tokens` rows (rounded up to `pad_to_multiple_of`): the old rows
        kept, new rows the mean of the old ones (mean_resizing) or N(0, initializer_range); an untied MLM
        decoder and its bias likewise from their own old rows, a tied decoder's bias with zeros (as
        transformers'); config.vocab_size and model.vocab_size are updated (as transformers'). ValueError for a
        pad_to_multiple_of that is not an integer >= 1 (transformers' error type)."""
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                               or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be an integer >= 1 (the vocabulary is padded to a multiple of "
                             f"it), got {pad_to_multiple_of!r}")
        old = self.get_input_embeddings()
        size = old.num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        if size == old.num_embeddings:
            return old
        std = self.config.initializer_range
        new = nn.Embedding(size, old.embedding_dim, padding_idx=old.padding_idx, device=old.weight.device,
                           dtype=old.weight.dtype)
        resize_rows(new.weight, old.weight, mean_resizing, std)
        new.weight.requires_grad_(old.weight.requires_grad)
        self.set_input_embeddings(new)
        if isinstance(self, MLMHeadMixin):
            if not self.config.tie_word_embeddings:  # the trained decoder's rows stay; new rows from its own
                old_decoder = self.get_output_embeddings()
                old_bias = getattr(old_decoder, "bias", None)  # None: a decoder set without one
                decoder = nn.Linear(old.embedding_dim, size, bias=old_bias is not None, device=old.weight.device,
                                    dtype=old.weight.dtype)
                resize_rows(decoder.weight, old_decoder.weight, mean_resizing, std)
                if old_bias is not None:
                    resize_rows(decoder.bias, old_bias, mean_resizing, 0.0)
                decoder._is_hf_initialized = True  # its rows are set: a later post_init keeps them
                self.set_output_embeddings(decoder)  # as transformers': BERT's and MPNet's heads take its bias
            else:
                self.resize_output_bias(size)
        new._is_hf_initialized = True
        self.config.vocab_size = self.vocab_size = size
        self.tie_weights()
        return new

    def _outputs(self, result, return_dict: bool | None):
        """The ModelOutput, or transformers' tuple of it where return_dict (default: config.return_dict) is False."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else outputs.transformers_tuple(result)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load an HF BERT checkpoint: a local directory or a hub id (through the HF cache, offline included).

        Takes transformers' keyword arguments: config=, dtype= / torch_dtype= ("auto", the default: config.json's
        dtype, else the weights'), device_map= (one device), add_pooling_layer= (base models),
        output_loading_info= (transformers' dict of sets),
        state_dict= (with a None path: config= and state_dict= only), ignore_mismatched_sizes= (tensors of
        other shapes initialised anew; without it a RuntimeError), the hub arguments (revision, cache_dir,
        token, local_files_only, subfolder, force_download); any other keyword overrides a config field
        (e.g. backend="triton", num_labels=3). Loader features fastbert does not implement
        (attn_implementation, quantization, multi-device maps, ...) are errors, never ignored.
        The model is built on the meta device and the weights assigned, so nothing is randomly initialised
        but weights the checkpoint lacks (reported in a warning and in output_loading_info).
        """
        return hf.load_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Write config.json + model.safetensors that transformers' from_pretrained loads unchanged.
        Takes transformers' is_main_process=, state_dict=, safe_serialization= (False: pytorch_model.bin)
        and max_shard_size= (shards + index.json)."""
        hf.save_pretrained(self, save_directory, **kwargs)

    def to_hf(self):
        """The same model as a transformers object with identical weights (needs transformers)."""
        return hf.to_hf(self)


class BertModel(BertPreTrainedModel):
    """Embeddings, L encoder layers and the [CLS] pooler.

    Layouts: padded input_ids [B, S] with attention_mask (1 = token, 0 = padding; transformers' 4-D
    masks are accepted when they mask keys only); with config.unpad the layers run on packed rows
    (ops.unpad: the real tokens first, then the padding, each sequence's padding a sequence of its own), B*S
    of them, so no FLOP is saved on padding. Packed inputs need no mask: input_ids [1, T] with cu_seqlens
    int32 [B+1] and max_seqlen (>= the longest sequence; default min(T, the longest sequence the positions
    allow)), as transformers' DataCollatorWithFlattening gives them (its cu_seq_lens_q / max_length_q names
    are accepted too); position_ids default to restarting at each sequence: the exact T tokens. Every layout
    has sizes from the shapes and no value check waits for the device: no host sync, static shapes for
    torch.compile, torch.export and CUDA graphs.
    """

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        """ValueError naming the field where `config` is not a BERT fastbert builds (checked here, not when
        the config is constructed or edited, as transformers)."""
        config.validate()
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        if config.embedding_width != config.hidden_size:  # ELECTRA's small embeddings
            self.embeddings_project = nn.Linear(config.embedding_width, config.hidden_size)
        setattr(self, self.encoder_name, self.encoder_class(config))
        if self.has_pooler:
            self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    # the architecture's modules and their names (fastbert.family's models change them)
    embeddings_class = BertEmbeddings
    encoder_class = BertEncoder
    encoder_name = "encoder"
    has_pooler = True  # a [CLS] pooler (when add_pooling_layer); DistilBERT and ELECTRA have none
    # transformers' output has cross_attentions, () for an encoder, with output_attentions (not DistilBERT's, MPNet's)
    has_cross_attentions = True
    # transformers' model takes a cache, which PEFT's prefix tuning fills with its prefix keys (fastbert.prefix)
    takes_cache = True

    def embed(self, input_ids, token_type_ids, position_ids, inputs_embeds, cache_length: int = 0):
        """The embeddings' output, projected to hidden_size where the tables are narrower (ELECTRA); positions
        start after cache_length prefix keys (architectures that take a cache)."""
        inputs = (input_ids, token_type_ids, position_ids, inputs_embeds)
        hidden = self.embeddings(*inputs, cache_length=cache_length) if cache_length else self.embeddings(*inputs)
        project = getattr(self, "embeddings_project", None)
        return hidden if project is None else project(hidden)

    def encode(self, hidden, layout: AttentionLayout, output_hidden_states, output_attentions):
        return getattr(self, self.encoder_name)(hidden, layout, output_hidden_states, output_attentions)

    def pool(self, sequence_output):
        pooler = getattr(self, "pooler", None)
        return None if pooler is None else pooler(sequence_output)

    def unpads(self, hidden) -> bool:
        """Whether config.unpad unpads this batch (hidden: the embeddings): always, as the user asked
        (ModernBERT, which always asks, only on the kernels)."""
        return True

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, *, output_hidden_states=None, output_attentions=None, return_dict=None,
                validate=True, cache=None, **kwargs):
        config = self.config
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        # prefix keys (fastbert.prefix): [B, heads, P, d] a layer, the mask [B, P + S]; no call without them (host time)
        if "past_key_values" in kwargs:
            cache = cache_argument(cache, kwargs)
        prefixes, prefix_length = (None, 0) if cache is None else prefix_keys(self, cache)
        packed = packed_arguments(kwargs)
        if packed:
            if prefixes is not None:
                raise ValueError("a cache (prefix keys) takes padded inputs [batch, seq_len], not packed ones")
            result = self._forward_packed(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                          output_hidden_states, output_attentions, validate, **packed)
            return self._outputs(result, return_dict)
        attention_mask = key_padding_mask(attention_mask, validate)
        batch, seqlen = check_model_inputs(config, input_ids, attention_mask, token_type_ids, position_ids,
                                           inputs_embeds, validate, prefix_length=prefix_length)
        if prefixes is not None:
            check_batch(prefixes, batch, (input_ids if input_ids is not None else inputs_embeds).device)
        hidden = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds, prefix_length)  # [B, S, H]
        unpadded = (config.unpad and attention_mask is not None and not output_attentions and prefixes is None
                    and self.unpads(hidden))
        if unpadded:
            hidden, indices, cu_seqlens, max_seqlen = ops.unpad(hidden, attention_mask)  # [T, H]
            layout = AttentionLayout(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        else:
            layout = AttentionLayout(attention_mask=attention_mask, prefixes=prefixes)
        hidden, all_hidden, all_probs = self.encode(hidden, layout, output_hidden_states, output_attentions)
        if unpadded:
            hidden = ops.pad(hidden, indices, batch, seqlen)
            if all_hidden is not None:
                all_hidden = [None if h is None else ops.pad(h, indices, batch, seqlen) for h in all_hidden]
        result = outputs.BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden,
            pooler_output=self.pool(hidden),
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_probs) if all_probs is not None else None,
            cross_attentions=() if output_attentions and self.has_cross_attentions else None)
        return self._outputs(result, return_dict)

    def _forward_packed(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                        output_hidden_states, output_attentions, validate, cu_seqlens, max_seqlen=None):
        config = self.config
        if max_seqlen is None:  # not given: a bound from the shapes (reading the longest would be a host sync)
            max_seqlen = min((input_ids if input_ids is not None else inputs_embeds).shape[1],
                             config.max_sequence_length)
        check_packed_inputs(config, input_ids, attention_mask, inputs_embeds, cu_seqlens, max_seqlen,
                            output_attentions, validate)
        check_model_inputs(config, input_ids, None, token_type_ids, position_ids, inputs_embeds, validate,
                           packed=True)
        if position_ids is None:  # each token's offset in its own sequence
            total = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
            sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
            position_ids = (tokens - cu_seqlens[sequence] + config.position_offset).long()[None]
        hidden = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds)[0]  # [T, H]
        layout = AttentionLayout(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        hidden, all_hidden, _ = self.encode(hidden, layout, output_hidden_states, False)
        first_tokens = hidden[cu_seqlens[:-1].long()][:, None]  # [B, 1, H]: each sequence's [CLS]
        return outputs.BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden[None],  # [1, T, H]
            pooler_output=self.pool(first_tokens),
            hidden_states=None if all_hidden is None else tuple(None if h is None else h[None] for h in all_hidden))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden):
        return gelu_dense_norm(self.config, self.dense, self.LayerNorm, hidden)


def gelu_dense_norm(config: BertConfig, dense: nn.Module, norm: nn.Module, hidden, approximate: str | None = None):
    """norm(gelu(dense(hidden))): the transform of the family's masked-LM heads (GELU's form as _gelu_linear)."""
    return layer_norm(config, norm, _gelu_linear(dense, hidden, config, approximate))


def labelled_positions(labels, budget: int) -> torch.Tensor | None:
    """Which positions the MLM loss reads: an index into the flattened [B*S] positions of labels [B, S]
    (-100 = not labelled), or None for all of them. Sizes from the shapes: no host sync, static for
    torch.compile / export.

    budget 0: every position, the labelled ones first in order, then the unlabelled ones, which the loss
    ignores (B*S rows): the loss, the accuracy and the gradients of the labelled positions alone (in the same
    order, so the loss's sums run as they would over those rows), at the cost of the head's transform and
    decoder over every row (a kernel could skip the all-ignored row blocks at the end). budget K > 0: K
    positions per sequence, the labelled ones first in order, then unlabelled ones that the loss ignores
    (B*K rows)."""
    seqlen = labels.shape[-1]
    if budget == 0:  # a stable sort on "unlabelled" puts the labelled positions first, in order
        return torch.sort((labels.reshape(-1) == IGNORE_INDEX).to(torch.uint8), stable=True).indices  # [B*S]
    if budget >= seqlen:
        return None
    # the same per sequence: each sequence's labelled positions first, in order
    order = torch.sort((labels == IGNORE_INDEX).to(torch.uint8), dim=-1, stable=True).indices[..., :budget]
    starts = torch.arange(0, labels.numel(), seqlen, device=labels.device)  # each sequence's first position
    return (order + starts[:, None]).reshape(-1)  # [B*K]


def _rows(tensor, index, positions: int):
    """tensor [B, S, ...] flattened to its B*S positions, then the rows `index` picks (None: all)."""
    flat = tensor.reshape(positions, *tensor.shape[2:])
    return flat if index is None else flat.index_select(0, index)


@dataclass
class VocabularyHead:
    """A masked-LM head whatever its module names (the family's one implementation): `transform` [N, H] ->
    [N, H'], then the decoder to the vocabulary plus `bias`. bias_in_decoder: decoder(x) already adds the
    bias (the decoder's own bias, which BERT's and RoBERTa's heads tie to theirs unless tie_word_embeddings is
    False; DistilBERT's, ELECTRA's and ModernBERT's decoders own theirs)."""
    config: BertConfig
    transform: object  # callable
    decoder: nn.Module  # Linear H' -> V, its weight tied to the word embeddings
    bias: torch.Tensor  # [V]
    bias_in_decoder: bool = False

    def logits(self, sequence_output):
        """Logits for every position: [B, S, H] -> [B, S, V]."""
        return self._logits(self.transform(sequence_output))

    def _logits(self, transformed):
        if is_plain_linear(self.decoder):
            return F.linear(transformed, self.decoder.weight, self.bias)
        logits = self.decoder(transformed)  # a wrapped decoder is called
        return logits if self.bias_in_decoder else logits + self.bias

    def masked_loss(self, sequence_output, labels, max_predictions: int = 0, shown_masked=None):
        """Cross entropy over the labelled positions (labels != -100), averaged over them: the transform runs
        on the rows `labelled_positions` picks (max_predictions as config.max_predictions_per_seq), and the
        fused decoder + softmax never holds [rows, V] logits. Returns (loss, accuracy, masked_accuracy),
        0-dim tensors; no host sync.

        shown_masked: bool [B, S] or None, the positions whose input is [MASK]. With it, masked_accuracy is
        the accuracy at those positions alone, which copying the input cannot raise (one more forward of
        the decoder over the rows, without gradient); without it, None.
        """
        index = labelled_positions(labels, max_predictions)
        positions = labels.numel()
        targets = _rows(labels, index, positions)
        transformed = self.transform(_rows(sequence_output, index, positions))
        loss, correct = self._cross_entropy(transformed, targets)
        accuracy = correct / (targets != IGNORE_INDEX).sum().clamp(min=1)
        if shown_masked is None:
            return loss, accuracy, None
        shown = _rows(shown_masked, index, positions)
        with torch.no_grad():
            _, masked_correct = self._cross_entropy(transformed.detach(), targets.masked_fill(~shown, IGNORE_INDEX))
        return loss, accuracy, masked_correct / ((targets != IGNORE_INDEX) & shown).sum().clamp(min=1)

    def _cross_entropy(self, transformed, targets):
        """(mean loss over the labelled rows, number right) of the decoder on transformed [N, H]."""
        if is_plain_linear(self.decoder):
            return ops.linear_cross_entropy(transformed, self.decoder.weight, self.bias, targets,
                                            backend=self.config.backend)
        logits = self._logits(transformed).float()  # a wrapped decoder is called: these rows' logits exist
        labelled = (targets != IGNORE_INDEX).sum().clamp(min=1)
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / labelled
        return loss, ((logits.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum()


def _decoder_bias_from_head(state_dict, prefix, *args) -> None:
    """A state dict of BertLMPredictionHead as fastbert wrote it before its decoder had a bias (and transformers 4's
    saved files) holds the head's bias alone, which is what its logits added: the decoder's bias is that one."""
    if prefix + "decoder.bias" not in state_dict and prefix + "bias" in state_dict:
        state_dict[prefix + "decoder.bias"] = state_dict[prefix + "bias"]


class BertLMPredictionHead(nn.Module):
    """transform -> decoder tied to the word embeddings, with a bias tied to the head's `bias`: transformers' module
    and parameter names, so that state dicts load strictly either way. With tie_word_embeddings=False the decoder's
    bias is a parameter of its own, as in transformers, and the head's `bias` is unused."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # zeros, tied to `bias` by tie_weights: an nn.Linear's own bias would draw (and waste) random numbers, and
        # with them change every weight a seeded model initialises after it
        self.decoder.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self._register_load_state_dict_pre_hook(_decoder_bias_from_head)

    def vocabulary_head(self) -> VocabularyHead:
        # the logits add the decoder's bias, as transformers' forward calls the decoder; a decoder set without
        # one (set_output_embeddings) adds the head's
        if getattr(self.decoder, "bias", None) is not None:
            return VocabularyHead(self.config, self.transform, self.decoder, self.decoder.bias, bias_in_decoder=True)
        return VocabularyHead(self.config, self.transform, self.decoder, self.bias)

    def forward(self, sequence_output):
        """Logits for every position: [B, S, H] -> [B, S, V]."""
        return self.vocabulary_head().logits(sequence_output)

    def masked_loss(self, sequence_output, labels, max_predictions: int = 0, shown_masked=None):
        """VocabularyHead.masked_loss."""
        return self.vocabulary_head().masked_loss(sequence_output, labels, max_predictions, shown_masked)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


def _wants_logits(module: nn.Module, labels, return_logits: bool | None) -> bool:
    """Full [B, S, V] logits when asked, or by default when there are no labels or in eval mode."""
    return return_logits if return_logits is not None else (labels is None or not module.training)


def _nsp_loss(logits, labels):
    """(loss, accuracy) of the 2-way next-sentence classifier. logits [B, 2], labels [B]."""
    return F.cross_entropy(logits, labels), (logits.argmax(dim=-1) == labels).float().mean()


class MLMHeadMixin:
    """The tied MLM decoder as transformers' output embeddings; its module and bias are at decoder_path and
    bias_path (the architecture's names)."""

    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                          "cls.predictions.decoder.bias": "cls.predictions.bias"}
    decoder_path, bias_path = "cls.predictions.decoder", "cls.predictions.bias"
    output_embeddings_bring_bias = True  # set_output_embeddings makes the new decoder's bias the head's (BERT's)

    def vocabulary_head(self) -> VocabularyHead:
        return self.cls.predictions.vocabulary_head()

    def get_output_embeddings(self) -> nn.Module:
        return self.get_submodule(self.decoder_path)

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        _set_path(self, self.decoder_path, new_embeddings)
        if self.output_embeddings_bring_bias and getattr(new_embeddings, "bias", None) is not None:
            _set_path(self, self.bias_path, new_embeddings.bias)

    def resize_output_bias(self, size: int) -> None:
        """The tied decoder's bias at `size` entries, its old ones kept, new ones zero (resize_token_embeddings, as
        transformers')."""
        old = self.get_parameter(self.bias_path)
        bias = old.new_zeros(size)
        resize_rows(bias, old, False, 0.0)
        bias = nn.Parameter(bias, requires_grad=old.requires_grad)
        _set_path(self, self.bias_path, bias)
        decoder = self.get_output_embeddings()
        if getattr(decoder, "bias", None) is old:  # the decoder adds the head's bias itself (tied)
            decoder.bias = bias


@torch.no_grad()
def resize_rows(new: torch.Tensor, old: torch.Tensor, mean_resizing: bool, std: float) -> None:
    """Fill `new` (a resized table [V', ...] or bias [V']) from `old` [V, ...] as transformers' resize_token_embeddings
    does: old's rows kept, rows past them the mean of old's (mean_resizing, computed in fp32; transformers samples
    around it at 1e-9 of their covariance) or N(0, std) (std 0: zeros)."""
    kept = min(len(new), len(old))
    new[:kept] = old[:kept]
    if len(new) > kept and mean_resizing:
        new[kept:] = old.float().mean(dim=0).to(new.dtype)
    elif len(new) > kept:
        new[kept:].normal_(0.0, std)


def _set_path(root: nn.Module, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent), name, value)


class BertForPreTraining(MLMHeadMixin, BertPreTrainedModel):
    """BERT's pretraining model: masked LM + next sentence prediction; loss = MLM + NSP.

    With labels the MLM loss is that of the labelled positions only (BertLMPredictionHead.masked_loss; set
    config.max_predictions_per_seq to run the head on that many positions per sequence instead of all).
    return_logits: None (default) returns prediction_logits when there are no labels or in eval mode;
    False never materialises them (the training path); True always does. mask_token_id (with labels):
    also report mlm_mask_accuracy, the accuracy at the positions whose input is that token.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, *, output_hidden_states=None,
                output_attentions=None, return_dict=None, return_logits=None, validate=True, mask_token_id=None,
                **kwargs):
        if mask_token_id is not None and input_ids is None:
            raise ValueError("mask_token_id needs input_ids (the [MASK] positions are read from them)")
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True, validate=validate, **kwargs)
        sequence_output = base.last_hidden_state
        labels = check_labels("labels", labels, sequence_output.shape[:2], self.config.vocab_size, "vocab_size",
                              validate)
        check_label_budget(labels, self.config.max_predictions_per_seq, validate)
        next_sentence_label = check_labels("next_sentence_label", next_sentence_label, base.pooler_output.shape[:1],
                                           2, "2 classes", validate)
        head = self.cls.predictions
        mlm_loss = mlm_accuracy = mlm_mask_accuracy = nsp_loss = nsp_accuracy = None
        if labels is not None:
            shown_masked = None if mask_token_id is None else input_ids == mask_token_id
            mlm_loss, mlm_accuracy, mlm_mask_accuracy = head.masked_loss(
                sequence_output, labels, self.config.max_predictions_per_seq, shown_masked)
        nsp_logits = self.cls.seq_relationship(base.pooler_output)  # [B, 2]
        if next_sentence_label is not None:
            nsp_loss, nsp_accuracy = _nsp_loss(nsp_logits, next_sentence_label)
        terms = [t for t in (mlm_loss, nsp_loss) if t is not None]
        result = outputs.BertForPreTrainingOutput(
            loss=sum(terms) if terms else None,
            prediction_logits=head(sequence_output) if _wants_logits(self, labels, return_logits) else None,
            seq_relationship_logits=nsp_logits, hidden_states=base.hidden_states, attentions=base.attentions,
            mlm_loss=mlm_loss, nsp_loss=nsp_loss, mlm_accuracy=mlm_accuracy,
            mlm_mask_accuracy=mlm_mask_accuracy, nsp_accuracy=nsp_accuracy)
        return self._outputs(result, return_dict)


class BertForMaskedLM(MLMHeadMixin, BertPreTrainedModel):
    """Masked LM head only (no pooler). Loss and return_logits as in BertForPreTraining."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, return_logits=None, validate=True, mask_token_id=None, **kwargs):
        """mask_token_id (with labels): also report mask_accuracy, the accuracy at the positions whose input
        is that token (as BertForPreTraining's mlm_mask_accuracy)."""
        if mask_token_id is not None and input_ids is None:
            raise ValueError("mask_token_id needs input_ids (the [MASK] positions are read from them)")
        if token_type_ids is not None:  # the family's models without token types take no such argument
            kwargs["token_type_ids"] = token_type_ids
        base = self._bert()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                            output_attentions=output_attentions, return_dict=True, validate=validate, **kwargs)
        sequence_output = base.last_hidden_state
        labels = check_labels("labels", labels, sequence_output.shape[:2], self.config.vocab_size, "vocab_size",
                              validate)
        check_label_budget(labels, self.config.max_predictions_per_seq, validate)
        head = self.vocabulary_head()
        loss = accuracy = mask_accuracy = None
        if labels is not None:
            shown_masked = None if mask_token_id is None else input_ids == mask_token_id
            loss, accuracy, mask_accuracy = head.masked_loss(sequence_output, labels,
                                                             self.config.max_predictions_per_seq, shown_masked)
        result = outputs.MaskedLMOutput(
            loss=loss, logits=head.logits(sequence_output) if _wants_logits(self, labels, return_logits) else None,
            hidden_states=base.hidden_states, attentions=base.attentions, accuracy=accuracy,
            mask_accuracy=mask_accuracy)
        return self._outputs(result, return_dict)


class BertForNextSentencePrediction(BertPreTrainedModel):
    """BertModel -> the pooled [CLS] -> 2 logits (is sentence B the one that followed A?), the paper's NSP head alone;
    labels [B] (0: B follows A, 1: a random sentence) give their cross entropy."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, validate=True, **kwargs):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True, validate=validate, **kwargs)
        logits = self.cls.seq_relationship(base.pooler_output)  # [B, 2]
        labels = check_labels("labels", labels, logits.shape[:1], 2, "2 classes", validate)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        result = outputs.NextSentencePredictorOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                     attentions=base.attentions)
        return self._outputs(result, return_dict)


class HeadDropout(nn.Dropout):
    """nn.Dropout (same p, state and repr as transformers' heads) that runs `ops.dropout` on the model's
    backend, read at forward time: on the Triton path no mask is kept for the backward."""

    def __init__(self, p: float, config: BertConfig):
        super().__init__(p)
        self.config = config

    def forward(self, hidden):
        return ops.dropout(hidden, self.p, self.training, backend=self.config.backend)


def _classifier_dropout(config: BertConfig) -> HeadDropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return HeadDropout(p, config)


class BertForSequenceClassification(BertPreTrainedModel):
    """Pooled [CLS] -> dropout -> Linear(num_labels). Loss as transformers chooses it by
    config.problem_type: regression (MSE) when num_labels == 1, single-label cross entropy for integer
    labels, multi-label BCE-with-logits for float labels."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, validate=True, **kwargs):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True, validate=validate, **kwargs)
        logits = self.classifier(self.dropout(base.pooler_output))  # [B, num_labels]
        loss = sequence_classification_loss(self.config, logits, labels, validate)
        result = outputs.SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                  attentions=base.attentions)
        return self._outputs(result, return_dict)


def sequence_classification_loss(config: BertConfig, logits, labels, validate: bool):
    """The loss transformers chooses by config.problem_type (set from the first labels it sees, as
    transformers does): MSE for regression (one output, or one per label), cross entropy for int64 or int32
    labels, BCE-with-logits for multi-labels; None without labels. logits [B, num_labels]."""
    if labels is None:
        return None
    num_labels = logits.shape[-1]
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression" and num_labels == 1:
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).reshape(logits.shape[:1]))
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits, check_labels("labels", labels, logits.shape[:1], num_labels, "num_labels",
                                                    validate))
    if tuple(labels.shape) != tuple(logits.shape):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(logits.shape)} "
                         f"for {config.problem_type} with {num_labels} labels")
    if config.problem_type == "regression":
        return F.mse_loss(logits, labels.to(logits.dtype))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class BertForTokenClassification(BertPreTrainedModel):
    """Per-token classifier. Padding is never a token: labels at padded positions are ignored, whatever
    their value (transformers counts them unless they are -100)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, validate=True, **kwargs):
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True, validate=validate, **kwargs)
        logits = self.classifier(self.dropout(base.last_hidden_state))  # [B, S, num_labels]
        loss = token_classification_loss(logits, labels, attention_mask, validate)
        result = outputs.TokenClassifierOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                               attentions=base.attentions)
        return self._outputs(result, return_dict)


def token_padding_mask(attention_mask, seqlen: int) -> torch.Tensor | None:
    """The tokens' padding mask [B, S] (1 = token) from a forward's attention_mask: transformers' 4-D masks
    reduced (key_padding_mask), the prefix keys' columns of a [B, P + S] mask (fastbert.prefix) left out."""
    mask = key_padding_mask(attention_mask, validate=False)
    return mask if mask is None or mask.shape[-1] == seqlen else mask[..., mask.shape[-1] - seqlen:]


def token_classification_loss(logits, labels, attention_mask, validate: bool):
    """Cross entropy of logits [B, S, num_labels] over labels [B, S] (-100 ignored), padding never a token
    whatever its label; None without labels."""
    num_labels = logits.shape[-1]
    labels = check_labels("labels", labels, logits.shape[:2], num_labels, "num_labels", validate)
    if labels is None:
        return None
    mask = token_padding_mask(attention_mask, logits.shape[1])
    if mask is not None:
        labels = labels.masked_fill(~mask.bool(), IGNORE_INDEX)
    return F.cross_entropy(logits.reshape(-1, num_labels), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def _refuse_packed(name: str, kwargs: dict) -> None:
    if any(k in kwargs for k in (*PACKED_ARGUMENTS, *HF_PACKED_ALIASES)):
        raise ValueError(f"{name} needs padded inputs [batch, seq_len] with attention_mask, not packed inputs")


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span extraction: start and end logits per token. Padding is never an answer: its logits are the
    dtype's lowest value, so the loss's softmax runs over the real tokens only (transformers' includes the
    padded positions, so its loss differs on padded batches), and a start or end position on padding is
    an error. Positions outside the sequence are clamped to S and ignored, as in transformers."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        if config.num_labels != 2:
            raise ValueError(f"BertForQuestionAnswering needs config.num_labels == 2 (start and end logits), "
                             f"got {config.num_labels}")
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, *, output_hidden_states=None,
                output_attentions=None, return_dict=None, validate=True, **kwargs):
        _refuse_packed("BertForQuestionAnswering", kwargs)
        base = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True, validate=validate, **kwargs)
        logits = self.qa_outputs(base.last_hidden_state)  # [B, S, 2]
        mask = token_padding_mask(attention_mask, logits.shape[1])
        if mask is not None:
            logits = logits.masked_fill(~mask.bool()[..., None], torch.finfo(logits.dtype).min)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            seqlen = start_logits.shape[1]
            clamped = []
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                if positions.is_floating_point() or positions.reshape(-1).shape != start_logits.shape[:1]:
                    raise ValueError(f"{name} must be integer positions of shape {tuple(start_logits.shape[:1])}, "
                                     f"got {positions.dtype} {tuple(positions.shape)}")
                positions = positions.reshape(-1).clamp(0, seqlen)
                if mask is not None and validate and not torch.compiler.is_compiling():
                    on_padding = (positions < seqlen) & ~mask.bool().gather(1, positions.clamp(max=seqlen - 1)[:, None])[:, 0]
                    check_on_device(~on_padding.any(), f"{name} points at padding: padding is never an answer",
                                    lambda: f"{name} points at padding in example(s) "
                                            f"{on_padding.nonzero().flatten().tolist()}: padding is never an answer")
                clamped.append(positions)
            start, end = clamped
            loss = (F.cross_entropy(start_logits, start, ignore_index=seqlen)
                    + F.cross_entropy(end_logits, end, ignore_index=seqlen)) / 2
        result = outputs.QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                                      hidden_states=base.hidden_states, attentions=base.attentions)
        return self._outputs(result, return_dict)


class BertForMultipleChoice(BertPreTrainedModel):
    """Inputs [B, choices, S]; each choice scored from its pooled [CLS]; logits [B, choices]."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, *, output_hidden_states=None, output_attentions=None,
                return_dict=None, validate=True, **kwargs):
        _refuse_packed("BertForMultipleChoice", kwargs)
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("input_ids must be [batch, num_choices, seq_len] (or inputs_embeds "
                             f"[batch, num_choices, seq_len, hidden]), got "
                             f"{None if source is None else tuple(source.shape)}")
        num_choices = source.shape[1]

        def flat(t):  # [B, C, S, ...] -> [B*C, S, ...]
            return None if t is None else t.reshape(-1, *t.shape[2:])

        base = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                         flat(inputs_embeds), output_hidden_states=output_hidden_states,
                         output_attentions=output_attentions, return_dict=True, validate=validate, **kwargs)
        logits = self.classifier(self.dropout(base.pooler_output)).view(-1, num_choices)  # [B, C]
        labels = check_labels("labels", labels, logits.shape[:1], num_choices, "num_choices", validate)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        result = outputs.MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                                   attentions=base.attentions)
        return self._outputs(result, return_dict)


MODEL_CLASSES = {cls.__name__: cls for cls in (
    BertModel, BertForPreTraining, BertForMaskedLM, BertForNextSentencePrediction,
    BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering, BertForMultipleChoice)}
