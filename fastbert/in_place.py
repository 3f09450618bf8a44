"""`fastbert.apply(model)`: run an existing transformers BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA,
DistilBERT or MPNet (any head) or a sentence-transformers model (SentenceTransformer, CrossEncoder) built on
one on fastbert's kernels, in place.

Every transformers base model inside `model` (BertModel, RobertaModel, ...: TRANSFORMERS_BASES) keeps its
class, its head and its parameters: its embeddings, encoder (DistilBERT's transformer) and pooler are
replaced by fastbert's modules built around the very same leaf modules (the Embeddings, Linears,
LayerNorms and Dropouts, or whatever wrapper a tool put in their place), and its forward becomes fastbert's.
Dropout follows transformers' switches as transformers does, read at each forward: each Dropout module's p
and training mode (ModernBERT's attention also its float attention_dropout), never the config, which
transformers reads only when it builds the modules.
Parameters are shared, never copied, so an optimizer, a Trainer, a pipeline
or a PEFT model built earlier keeps working; state_dict keys are unchanged. Heads and their losses stay
transformers' code.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from fastbert import architectures
from fastbert.hf import choose_layer_norm_backward

ACCELERATED = "_fastbert_model"  # instance attribute of an accelerated transformers base model
# transformers' base model classes fastbert accelerates (module, class name): fastbert's class of that name
TRANSFORMERS_BASES = (("bert", "BertModel"), ("roberta", "RobertaModel"), ("xlm_roberta", "XLMRobertaModel"),
                      ("camembert", "CamembertModel"), ("electra", "ElectraModel"),
                      ("distilbert", "DistilBertModel"), ("mpnet", "MPNetModel"), ("modernbert", "ModernBertModel"))


def _transformers_bases() -> dict[type, type]:
    """transformers' base model class -> fastbert's."""
    import importlib
    return {getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name):
            architectures.MODEL_CLASSES[name] for module, name in TRANSFORMERS_BASES}


def apply(model: nn.Module, **config_overrides) -> nn.Module:
    """Accelerate every transformers base model of the family inside `model` in place; return `model` itself.

    config_overrides set fastbert's switches (backend="triton", unpad=True) or other config fields;
    layer_norm_backward is "input" where a LayerNorm's weights need it (fastbert.hf.choose_layer_norm_backward)
    unless given here.
    Calling it again changes nothing. Raises TypeError when `model` holds no such model, and ValueError for
    a variant fastbert does not implement (a decoder, relative_key positions in a BERT config), naming the field.
    """
    from fastbert.modeling import BertPreTrainedModel

    bases = _transformers_bases()
    found = [(m, bases[type(m)]) for m in model.modules() if type(m) in bases]
    if not found and not any(isinstance(m, BertPreTrainedModel) for m in model.modules()):
        names = ", ".join(name for _, name in TRANSFORMERS_BASES)
        raise TypeError(f"fastbert.apply found no transformers base model ({names}) in {type(model).__name__}; "
                        "it takes one of them (any head), or a SentenceTransformer or CrossEncoder built on one")
    for base, fast_class in found:
        if ACCELERATED not in vars(base):
            _accelerate(base, fast_class, config_overrides)
    return model


def _accelerate(bert: nn.Module, fast_class: type, config_overrides: dict) -> None:
    config = architectures.config_from_dict(bert.config.to_dict(), **config_overrides)
    with torch.device("meta"):
        fast = fast_class(config, add_pooling_layer=getattr(bert, "pooler", None) is not None)
    fast.train(bert.training)  # before taking transformers' leaves, which keep their own modes
    before = {id(p) for p in bert.parameters()}
    for name, module in list(fast.named_modules()):
        if not module._modules:  # a leaf (weights, a Dropout): take transformers' module at the same path
            parent, _, attribute = name.rpartition(".")
            setattr(fast.get_submodule(parent), attribute, bert.get_submodule(name))
        elif hasattr(module, "attention_dropout"):  # ModernBERT's attention: its rate is a float attribute
            module.attention_dropout = bert.get_submodule(name).attention_dropout
    if {id(p) for p in fast.parameters()} != before:
        raise ValueError(f"fastbert.apply: the parameters of {type(bert).__name__} do not map one to one onto "
                         f"fastbert's {fast_class.__name__}; it is left unchanged")
    if "layer_norm_backward" not in config_overrides:
        choose_layer_norm_backward(fast, config)  # the weights are transformers', already loaded
    # transformers' position_ids / token_type_ids buffers (non-persistent: in no state_dict), which clients read
    for name, buffer in bert.embeddings.named_buffers(recurse=False):
        persistent = name not in bert.embeddings._non_persistent_buffers_set
        fast.embeddings.register_buffer(name, buffer, persistent=persistent)
    for name, child in fast.named_children():  # embeddings, encoder / transformer, pooler: fastbert's modules
        setattr(bert, name, child)
    vars(bert)[ACCELERATED] = fast  # not a registered child: its modules already are bert's
    # transformers' arguments, as code that reads the signature sees them (Trainer keeps the dataset columns
    # a forward names; sentence-transformers passes the features it names)
    signature = inspect.signature(bert.forward)
    forward = functools.partial(_forward, fast, bert.config, signature)
    forward.__signature__ = signature
    bert.forward = forward


def _forward(fast: nn.Module, hf_config, signature: inspect.Signature, *args, **kwargs):
    """fastbert's BertModel.forward called with the arguments of transformers' forward (`signature`: bound to it,
    so a positional argument means what it means there and a wrong call is its TypeError), with the defaults
    read from transformers' config, which clients change at run time (sentence-transformers sets
    output_hidden_states), and the vocabulary size, which transformers' resize_token_embeddings changes there
    (the input check reads fastbert's config)."""
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

    arguments = signature.bind(*args, **kwargs).arguments
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    for name in ("output_hidden_states", "output_attentions", "return_dict"):
        if arguments.get(name) is None:
            arguments[name] = getattr(hf_config, name)
    fast.config.vocab_size = hf_config.vocab_size
    result = fast.forward(**arguments)
    if isinstance(result, tuple):
        return result
    # transformers' own output class: its heads also read the decoder fields (BertLMHeadModel: cache), None here
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=result.last_hidden_state, pooler_output=result.pooler_output,
        hidden_states=result.hidden_states, attentions=result.attentions)
