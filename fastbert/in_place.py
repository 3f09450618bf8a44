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
transformers' code, but for the training step of the masked-LM heads (BertForPreTraining, BertForMaskedLM and
the family's *ForMaskedLM): in training mode with labels (BertForPreTraining: with both labels, without which
transformers computes no loss) their loss is fastbert's masked-only loss (the head's transform on the labelled
positions only, the decoder fused with the cross entropy, no [B, S, V] logits) through fastbert's head class
built around transformers' modules, and their logits are None. return_logits=True asks for transformers' own
forward there too, return_logits=False for the fused loss in eval mode as well (fastbert's own MLM classes
take the same switch).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastbert import architectures
from fastbert.hf import choose_layer_norm_backward, pooler_argument

logger = logging.getLogger("fastbert")

ACCELERATED = "_fastbert_model"  # instance attribute of an accelerated transformers base model
ACCELERATED_HEAD = "_fastbert_head"  # instance attribute of a transformers MLM head model: fastbert's head on it
# transformers' MLM heads whose loss is its loss_function, which takes Trainer's num_items_in_batch (a sum over
# the batch's labels divided by it); the others' is a mean CrossEntropyLoss whatever Trainer passes
SUMMED_LOSS_HEADS = ("ModernBertForMaskedLM",)
# transformers' base model classes fastbert accelerates (module, class name): fastbert's class of that name
TRANSFORMERS_BASES = (("bert", "BertModel"), ("roberta", "RobertaModel"), ("xlm_roberta", "XLMRobertaModel"),
                      ("camembert", "CamembertModel"), ("electra", "ElectraModel"),
                      ("distilbert", "DistilBertModel"), ("mpnet", "MPNetModel"), ("modernbert", "ModernBertModel"))


def _transformers_bases() -> dict[type, type]:
    """transformers' base model class -> fastbert's."""
    return {getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name):
            architectures.MODEL_CLASSES[name] for module, name in TRANSFORMERS_BASES}


def apply(model: nn.Module, **config_overrides) -> nn.Module:
    """Accelerate every transformers base model of the family inside `model` in place; return `model` itself.

    config_overrides set fastbert's switches (backend="triton", unpad=True) or other config fields;
    layer_norm_backward is "input" where a LayerNorm's weights need it (fastbert.hf.choose_layer_norm_backward)
    unless given here.
    Calling it again accelerates nothing twice: it sets the switches given (FASTBERT_FIELDS: backend, unpad,
    max_predictions_per_seq, ...) on the config the accelerated models (or fastbert's own) run with; any other
    field is a ValueError, as it shaped modules already built. Raises TypeError when `model` holds no such
    model, and ValueError for a variant fastbert does not implement (a decoder, relative_key positions in a
    BERT config), naming the field.
    """
    from fastbert.modeling import BertPreTrainedModel

    dispatched = next((name for name, m in model.named_modules() if "_hf_hook" in vars(m)), None)
    if dispatched is not None:
        raise ValueError(f"fastbert.apply: {type(model).__name__} was dispatched by accelerate (device_map, "
                         f"offloading; a hook on {dispatched or 'the model'}): apply replaces the modules that carry "
                         "those hooks, so they would no longer move weights or activations; load the model on one "
                         "device, then apply")
    bases = _transformers_bases()
    found = [(m, bases[type(m)]) for m in model.modules() if type(m) in bases]
    if not found and not any(isinstance(m, BertPreTrainedModel) for m in model.modules()):
        names = ", ".join(name for _, name in TRANSFORMERS_BASES)
        raise TypeError(f"fastbert.apply found no transformers base model ({names}) in {type(model).__name__}; "
                        "it takes one of them (any head), or a SentenceTransformer or CrossEncoder built on one")
    for base, fast_class in found:
        if ACCELERATED not in vars(base):
            _accelerate(base, fast_class, config_overrides)
        elif config_overrides:
            _set_switches(vars(base)[ACCELERATED].config, config_overrides)
    for module in model.modules() if found else ():  # what activation_checkpointing_enable calls, wherever called
        if _holds_accelerated(module) and "_set_gradient_checkpointing" not in vars(module):
            module._set_gradient_checkpointing = functools.partial(_set_gradient_checkpointing, module)
    if not found and config_overrides:  # fastbert's own models
        for config in {id(m.config): m.config for m in model.modules() if isinstance(m, BertPreTrainedModel)}.values():
            _set_switches(config, config_overrides)
    for head in model.modules():
        if _is_transformers_mlm_head(head) and ACCELERATED_HEAD not in vars(head):
            _accelerate_mlm_head(head)
    return model


def _holds_accelerated(module: nn.Module) -> bool:
    """Whether `module` is a transformers model (not fastbert's own) holding a base model apply accelerated, whose
    _set_gradient_checkpointing is transformers' present one: one of the format before transformers 4.35 (remote
    code's `(module, value)`, which transformers calls otherwise) is left as it is."""
    from transformers import PreTrainedModel

    from fastbert.modeling import BertPreTrainedModel

    return (isinstance(module, PreTrainedModel) and not isinstance(module, BertPreTrainedModel)
            and "value" not in inspect.signature(type(module)._set_gradient_checkpointing).parameters
            and any(ACCELERATED in vars(m) for m in module.modules()))


def _set_gradient_checkpointing(model: nn.Module, enable: bool = True, gradient_checkpointing_func=checkpoint,
                                every_n_layers: int = 1) -> None:
    """transformers' _set_gradient_checkpointing of `model`, and its every_n_layers for the fastbert encoders apply
    put there, whose layers transformers does not count (modeling.set_gradient_checkpointing)."""
    from fastbert.modeling import set_gradient_checkpointing

    set_gradient_checkpointing(model, functools.partial(type(model)._set_gradient_checkpointing, model), enable,
                               gradient_checkpointing_func, every_n_layers)


def _set_switches(config, overrides: dict) -> None:
    """fastbert's switches in `overrides` set on `config`, which a built model's forward reads (checked on a copy
    first, so that a bad value changes nothing); any other field shaped the modules already built: ValueError."""
    from fastbert.config import FASTBERT_FIELDS

    built = sorted(set(overrides) - set(FASTBERT_FIELDS))
    if built:
        raise ValueError(f"fastbert.apply: the model is accelerated already and {built} shaped the modules it "
                         f"built; a second call sets only fastbert's switches ({', '.join(FASTBERT_FIELDS)})")
    config.replace(**overrides)
    config.update_known(overrides, "fastbert.apply")


def fastbert_config(model: nn.Module):
    """The config fastbert runs `model` with: a fastbert model's own; for a transformers model after `apply`, its
    accelerated base's (which its fused MLM head shares, so a change such as max_predictions_per_seq reaches
    both); None for a model fastbert does not run."""
    from fastbert.modeling import BertPreTrainedModel

    if isinstance(model, BertPreTrainedModel):
        return model.config
    return next((vars(m)[ACCELERATED].config for m in model.modules() if ACCELERATED in vars(m)), None)


def _is_transformers_mlm_head(module: nn.Module) -> bool:
    """A transformers MLM head model (of a class fastbert has with a masked-only loss) whose base is accelerated."""
    from fastbert.modeling import MLMHeadMixin

    name = type(module).__name__
    fast_class = architectures.MODEL_CLASSES.get(name)
    base = getattr(module, getattr(module, "base_model_prefix", ""), None)
    return (fast_class is not None and issubclass(fast_class, MLMHeadMixin)
            and getattr(importlib.import_module("transformers"), name, None) is type(module)
            and base is not None and ACCELERATED in vars(base))


def _accelerate_mlm_head(head: nn.Module) -> None:
    """Give a transformers MLM head model the fused masked-only loss for its training step: fastbert's class of
    the same name built around transformers' modules (its base: transformers' base, accelerated; its head's
    leaves and the parameters its modules hold themselves: transformers'), called by the head's forward where
    it may (_mlm_forward). A head whose parameters do not map onto fastbert's keeps transformers' forward."""
    from fastbert.modeling import has_own_forward

    if has_own_forward(head):  # set by code apply does not know: replacing it would stop it running
        logger.info("fastbert.apply: %s has a forward of its own; its loss stays transformers'", type(head).__name__)
        return
    prefix = head.base_model_prefix
    base = getattr(head, prefix)
    with torch.device("meta"):
        fast = architectures.MODEL_CLASSES[type(head).__name__](vars(base)[ACCELERATED].config)
    setattr(fast, prefix, base)  # transformers' base, whose forward is fastbert's
    taken = _take_modules(fast, head, skip=prefix)
    if {id(p) for p in fast.parameters()} != {id(p) for p in head.parameters()}:
        logger.info("fastbert.apply: the head of %s does not map onto fastbert's %s; its loss stays transformers'",
                    type(head).__name__, type(fast).__name__)
        return
    vars(head)[ACCELERATED_HEAD] = fast  # not a registered child: its modules already are head's
    output_class = _output_class(head)
    output_fields = tuple(field.name for field in dataclasses.fields(output_class))
    _replace_forward(head, _mlm_forward, head, fast, taken, output_class, output_fields)


def _take_modules(fast: nn.Module, theirs: nn.Module, skip: str | None = None) -> list[tuple[str, ...]]:
    """Put transformers' modules of `theirs` into fastbert's `fast` at the same paths: every leaf (weights, a
    Dropout, or whatever wrapper a tool put there), the parameters a module holds itself (BERT's and RoBERTa's
    head bias), ModernBERT's float attention_dropout. Paths under `skip` and paths transformers lacks are left
    as they are (a weight left behind fails the caller's parameter check). Returns the paths of the leaves and
    parameters taken, each as its attribute names (what _replaced_since reads)."""
    modules = [named for child, subtree in fast.named_children() if child != skip
               for named in subtree.named_modules(prefix=child)]
    taken = []
    for name, module in modules:
        source = _submodule(theirs, name)
        if source is None:
            continue
        if not module._modules:
            parent, _, attribute = name.rpartition(".")
            setattr(fast.get_submodule(parent), attribute, source)
            taken.append(tuple(name.split(".")))
            continue
        for attribute in [a for a in module._parameters if isinstance(getattr(source, a, None), nn.Parameter)]:
            setattr(module, attribute, getattr(source, attribute))
            taken.append((*name.split("."), attribute))
        if hasattr(module, "attention_dropout"):  # ModernBERT's attention: its rate is a float attribute
            module.attention_dropout = source.attention_dropout
    return taken


def _replaced_since(fast: nn.Module, theirs: nn.Module, taken: list[tuple[str, ...]]) -> bool:
    """Whether a module or parameter _take_modules took from `theirs` into `fast` was replaced in `theirs` since
    (or in a module above it there): identity checks only, which torch.compile traces and guards on."""
    for path in taken:
        ours, source = fast, theirs
        for attribute in path:
            ours, source = getattr(ours, attribute), getattr(source, attribute, None)
        if source is not ours:
            return True
    return False


def _replace_forward(module: nn.Module, function, *leading) -> None:
    """module.forward becomes function(*leading, parameters, ...) (the ForwardParameters of the forward it replaces,
    transformers'), keeping that forward's signature, which code reads: Trainer keeps the dataset columns a
    forward names, sentence-transformers passes the features it names."""
    signature = inspect.signature(module.forward)
    forward = functools.partial(function, *leading, ForwardParameters(signature, type(module).__name__))
    forward.__signature__ = signature
    module.forward = forward


class ForwardParameters:
    """A forward's parameters, read once at apply, for _bound: torch.compile refuses inspect.Signature.bind on a
    call whose keyword dict its caller changed (transformers' heads pop return_dict before calling the base)."""
    __slots__ = ("owner", "positional", "names", "any_keyword")

    def __init__(self, signature: inspect.Signature, owner: str):
        kinds = {name: parameter.kind for name, parameter in signature.parameters.items()}
        if inspect.Parameter.VAR_POSITIONAL in kinds.values():
            raise ValueError(f"fastbert.apply: {owner}.forward takes *args, which fastbert cannot name")
        self.owner = owner
        self.positional = tuple(name for name, kind in kinds.items()
                                if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        self.names = frozenset(name for name, kind in kinds.items() if kind is not inspect.Parameter.VAR_KEYWORD)
        self.any_keyword = inspect.Parameter.VAR_KEYWORD in kinds.values()


def _bound(parameters: ForwardParameters, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call by their names (what **kwargs took merged in): positional ones mean what they mean
    in the forward replaced, and a call it does not take is the TypeError Python's would be."""
    if len(args) > len(parameters.positional):
        raise TypeError(f"{parameters.owner}.forward() takes {len(parameters.positional)} positional arguments but "
                        f"{len(args)} were given")
    arguments = dict(zip(parameters.positional, args))
    for name, value in kwargs.items():
        if name in arguments:
            raise TypeError(f"{parameters.owner}.forward() got multiple values for argument '{name}'")
        if not parameters.any_keyword and name not in parameters.names:
            raise TypeError(f"{parameters.owner}.forward() got an unexpected keyword argument '{name}'")
        arguments[name] = value
    return arguments


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _mlm_forward(head: nn.Module, fast: nn.Module, taken: list[tuple[str, ...]], output_class: type,
                 output_fields: tuple[str, ...], parameters: ForwardParameters, *args,
                 return_logits: bool | None = None, **kwargs):
    """The MLM head model's forward (see the module docstring): transformers' own (its class's), or with labels
    in training mode (return_logits None) or with return_logits=False, fastbert's fused masked-only loss with no
    logits, in transformers' output class (its tuple with return_dict=False). `taken`: the paths of the head's
    modules and parameters fastbert's head `fast` holds (_take_modules); the output class and its fields are
    read once, at apply, as torch.compile traces neither the import nor dataclasses.fields of a class."""
    arguments = _bound(parameters, args, kwargs)
    labels = [arguments.get(name) for name in ("labels", "next_sentence_label") if name in parameters.names]
    logits = return_logits if return_logits is not None else not head.training
    if logits or any(label is None for label in labels) or _hooked_head(head):
        return type(head).forward(head, **arguments)
    # what replaced them since apply (resize_token_embeddings, a PEFT wrapper); taken only then, as changing
    # modules while torch.compile traces this forward breaks its graph
    if _replaced_since(fast, head, taken):
        _take_modules(fast, head, skip=head.base_model_prefix)
    return_dict = arguments.pop("return_dict", None)
    num_items = arguments.pop("num_items_in_batch", None)
    result = fast(**arguments, return_logits=False, return_dict=True)
    if num_items is not None and type(head).__name__ in SUMMED_LOSS_HEADS:  # transformers' sum over num_items
        counted = labels[0] != -100  # the labels fastbert's mean is over: without sparse prediction's ignored
        if getattr(head.config, "sparse_prediction", False):
            counted &= labels[0] != head.config.sparse_pred_ignore_index
        result.loss = result.loss * counted.sum() / num_items
    output = output_class(**{name: getattr(result, name, None) for name in output_fields})
    return_dict = head.config.return_dict if return_dict is None else return_dict
    return output if return_dict else output.to_tuple()


def _hooked_head(head: nn.Module) -> bool:
    """Whether a module of the head (outside its base) has hooks, which only transformers' forward runs (the fused
    path calls the head's leaves, wrapped or hooked, but not the modules around them)."""
    from fastbert.modeling import is_unhooked

    return any(not is_unhooked(module, type(module)) for name, child in head.named_children()
               if name != head.base_model_prefix for module in child.modules())


def _output_class(head: nn.Module) -> type:
    """transformers' output class of the head's forward (BertForPreTraining's own, MaskedLMOutput else)."""
    from transformers.modeling_outputs import MaskedLMOutput

    return getattr(importlib.import_module(type(head).__module__), f"{type(head).__name__}Output", MaskedLMOutput)


def _accelerate(bert: nn.Module, fast_class: type, config_overrides: dict) -> None:
    # the base model's config: without the head's problem_type, which transformers checks against num_labels when
    # a config is built but not when a user sets either later (a model it then runs, which a rebuilt config refused)
    values = {key: value for key, value in bert.config.to_dict().items() if key != "problem_type"}
    config = architectures.config_from_dict(values, **config_overrides)
    with torch.device("meta"):
        fast = fast_class(config, **pooler_argument(fast_class, bert))
    fast.train(bert.training)  # before taking transformers' leaves, which keep their own modes
    before = {id(p) for p in bert.parameters()}
    _take_modules(fast, bert)
    if {id(p) for p in fast.parameters()} != before:
        raise ValueError(f"fastbert.apply: the parameters of {type(bert).__name__} do not map one to one onto "
                         f"fastbert's {fast_class.__name__}; it is left unchanged")
    _refuse_lost_hooks(bert, {id(m) for m in fast.modules()})
    if "layer_norm_backward" not in config_overrides:
        choose_layer_norm_backward(fast, config)  # transformers' weights (on the meta device: not there to check)
    # transformers' position_ids / token_type_ids buffers (non-persistent: in no state_dict), which clients read
    for name, buffer in bert.embeddings.named_buffers(recurse=False):
        persistent = name not in bert.embeddings._non_persistent_buffers_set
        fast.embeddings.register_buffer(name, buffer, persistent=persistent)
    _take_checkpointing(bert, fast)
    # fastbert's modules -> transformers' at their paths, which they replace (a leaf taken is the same module)
    counterparts = {module: theirs for name, module in fast.named_modules()
                    if module is not fast and (theirs := _submodule(bert, name)) not in (None, module)}
    bert._init_weights = functools.partial(_init_weights, bert, counterparts)  # a partial: deepcopy maps its modules
    for name, child in fast.named_children():  # embeddings, encoder / transformer, pooler: fastbert's modules
        setattr(bert, name, child)
    vars(bert)[ACCELERATED] = fast  # not a registered child: its modules already are bert's
    _replace_forward(bert, _forward, fast, bert)


def _take_checkpointing(bert: nn.Module, fast: nn.Module) -> None:
    """Checkpointing enabled before apply (activation_checkpointing_enable, or a config.json asking for it) is set
    on transformers' layers, which apply replaces: fastbert's encoder takes it over, with their checkpoint function
    and every n-th layer as they were."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in bert.modules() if isinstance(module, GradientCheckpointingLayer)]
    checkpointed = [index for index, layer in enumerate(layers) if layer.gradient_checkpointing]
    if not checkpointed:
        return
    every = checkpointed[1] - checkpointed[0] if len(checkpointed) > 1 else len(layers)
    for module in fast.modules():
        if hasattr(module, "checkpointed_every"):  # fastbert's encoders
            module.gradient_checkpointing, module.checkpointed_every = True, every
            module._gradient_checkpointing_func = layers[checkpointed[0]]._gradient_checkpointing_func


def _init_weights(bert: nn.Module, counterparts: dict, module: nn.Module) -> None:
    """bert's _init_weights (transformers' init_weights after a model built on the meta device is materialised),
    which sets some weights and buffers by the class of the module holding them (BERT's embeddings' position_ids,
    DistilBERT's sinusoidal positions, ModernBERT's scaled projections): fastbert's module at a path where apply
    replaced transformers' (`counterparts`) also gets the init of transformers' module, whose children, parameters
    and buffers are first pointed at fastbert's module's own (the very leaves, shared), so that it inits those."""
    type(bert)._init_weights(bert, module)
    theirs = counterparts.get(module)
    if theirs is None:
        return
    for registry in ("_modules", "_parameters", "_buffers"):
        ours, stale = getattr(module, registry), getattr(theirs, registry)
        stale.update({key: ours[key] for key in stale if key in ours})
    type(bert)._init_weights(bert, theirs)


def _follow_replaced_child(fast: nn.Module, bert: nn.Module, name: str) -> None:
    """fast's child `name` becomes bert's, which code replaced since apply. An encoder fastbert does not run (its
    layers take fastbert's layout) is a ValueError naming it."""
    child = bert._modules.get(name)
    if name == getattr(fast, "encoder_name", None) and not isinstance(child, fast.encoder_class):
        raise ValueError(f"{type(bert).__name__}.{name} was replaced by a {type(child).__name__} after fastbert.apply; "
                         f"fastbert's forward runs its own {fast.encoder_class.__name__} (whose layers it calls with "
                         "its layout), so put the layers in that encoder's `layer` list instead")
    fast._modules[name] = child


def _refuse_lost_hooks(bert: nn.Module, kept: set[int]) -> None:
    """ValueError (`bert` left unchanged) naming a module of `bert` that apply would replace (kept: the ids of the
    modules fastbert's model takes) and whose forward hooks, or forward of its own, would then no longer run. The
    base model's own hooks stay: apply replaces its forward only."""
    from fastbert.modeling import has_hooks, has_own_forward

    for name, module in bert.named_modules():
        if id(module) in kept or not has_hooks(module) or module is bert and not has_own_forward(module):
            continue
        raise ValueError(f"fastbert.apply: {type(bert).__name__}.{name or 'forward'} has "
                         f"{'a forward of its own' if has_own_forward(module) else 'hooks'}, which would no longer "
                         "run: apply replaces that module with fastbert's (the Linears, LayerNorms and embeddings "
                         "inside stay, with their hooks); remove them, apply, then hook fastbert's module; it is "
                         "left unchanged")


def _forward(fast: nn.Module, bert: nn.Module, parameters: ForwardParameters, *args, **kwargs):
    """fastbert's BertModel.forward called with the arguments of transformers' forward (`parameters`: its, so a
    positional argument means what it means there and a wrong call is its TypeError), with the defaults
    read from transformers' config, which clients change at run time (sentence-transformers sets
    output_hidden_states), and the vocabulary size, which transformers' resize_token_embeddings changes there
    (the input check reads fastbert's config). A child of `bert` replaced since apply (a pooler of one's own, None,
    new embeddings) is the one run, as in transformers' forward."""
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

    hf_config, children = bert.config, bert._modules
    for name, child in fast._modules.items():  # identity checks, which torch.compile guards on
        if children.get(name) is not child:
            _follow_replaced_child(fast, bert, name)
    arguments = _bound(parameters, args, kwargs)
    for name in ("output_hidden_states", "output_attentions", "return_dict"):
        if arguments.get(name) is None:
            arguments[name] = getattr(hf_config, name)
    # a forward of transformers' older style (MPNet's: return_dict among its parameters) returns its tuple by
    # position, the pooler's place kept when None, which its heads index (outputs[2:]); fastbert's, as transformers'
    # newer ones, leaves out every None
    positional = not arguments["return_dict"] and "return_dict" in parameters.names
    if positional:
        arguments["return_dict"] = True
    fast.config.vocab_size = hf_config.vocab_size
    result = fast.forward(**arguments)
    if isinstance(result, tuple):
        return result
    if positional:
        return (result.last_hidden_state, result.pooler_output) + tuple(
            states for states in (result.hidden_states, result.attentions) if states is not None)
    # transformers' own output class: its heads also read the decoder fields (BertLMHeadModel: cache), None here
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=result.last_hidden_state, pooler_output=result.pooler_output,
        hidden_states=result.hidden_states, attentions=result.attentions, cross_attentions=result.cross_attentions)
