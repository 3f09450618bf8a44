"""HF checkpoint interop: read and write HF BERT directories, convert to and from transformers objects.

An HF directory is config.json + model.safetensors (or pytorch_model.bin, or sharded with an
index.json). Keys are normalised on load: legacy LayerNorm gamma/beta -> weight/bias, stray
position_ids / token_type_ids buffers dropped, the decoder's tied copies folded, and the `bert.`
prefix added or removed so that a BertModel loads from a BertForPreTraining checkpoint and back.
Loading builds the model on the meta device and assigns the checkpoint's tensors: no random init runs
but for the weights the checkpoint lacks. A checkpoint that does not match its config (missing encoder
layers, other sizes) is a CheckpointError naming the file and what is wrong.
transformers itself is needed only by `to_hf`.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import re

import torch

from fastbert import hub, ops
from fastbert.bases import HAVE_TRANSFORMERS
from fastbert.config import BertConfig
from fastbert.files import replaced_files

logger = logging.getLogger("fastbert")

SAFETENSORS_NAME = "model.safetensors"
TORCH_NAME = "pytorch_model.bin"
# Tied to bert.embeddings.word_embeddings.weight (and cls.predictions.bias): never stored twice.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")  # BERT's; see tied_keys
BUFFER_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")
BASE_MODULES = ("embeddings.", "encoder.", "transformer.", "pooler.", "embeddings_project.")  # the base
# models' children (BERT's, DistilBERT's transformer, ELECTRA's projection): what the base prefix prefixes
# weights without which the encoder is not the checkpoint's: missing ones are an error, not a random init
ENCODER_MODULES = ("embeddings.", "encoder.", "transformer.")
# transformers' from_pretrained arguments that change nothing here (loading is always on the meta device,
# the Auto classes' bookkeeping): accepted and ignored
IGNORED_LOADER_ARGUMENTS = ("low_cpu_mem_usage", "_from_auto", "_from_pipeline", "trust_remote_code")
# transformers' loader features fastbert does not implement, and why
UNSUPPORTED_LOADER_ARGUMENTS = {
    "attn_implementation": "fastbert runs its own attention kernels (config backend='auto'|'triton'|'torch')",
    "quantization_config": "quantized loading is not implemented; quantize the loaded model with your tool",
    "load_in_8bit": "quantized loading is not implemented", "load_in_4bit": "quantized loading is not implemented",
    "variant": "weight file variants are not implemented", "from_tf": "TensorFlow checkpoints are not read",
    "from_flax": "Flax checkpoints are not read", "gguf_file": "GGUF files are not read",
    "tp_plan": "tensor parallelism is not implemented", "key_mapping": "key remapping is not implemented",
    "max_memory": "device maps are one device only", "offload_folder": "offloading is not implemented",
    "offload_state_dict": "offloading is not implemented", "adapter_name": "load adapters with peft",
    "proxies": "pass proxies through huggingface_hub's environment variables (HTTPS_PROXY)",
}
UNSUPPORTED_SAVE_ARGUMENTS = {
    "push_to_hub": "save, then upload with huggingface_hub", "variant": "weight file variants are not implemented",
    "save_function": "custom save functions are not implemented", "save_peft_format": "save adapters with peft",
}


def small_weight_layer_norms(model: torch.nn.Module) -> dict[str, int]:
    """The LayerNorms of `model` whose backward from the output (layer_norm_backward="output") would give NaN
    gradients: name -> how many weights have |weight| < MIN_WEIGHT, for those with more than SIDE_COLUMNS
    (kernels/layer_norm.py). A host read of every LayerNorm weight (a sync each on a GPU, a collective each
    under FSDP2: every rank calls it): for load time or a loop that is stopping, never per step. Empty
    without Triton, whose absence leaves the torch path, exact for any weights."""
    kernel = ops.KERNELS.get("layer_norm")
    if kernel is None:
        return {}
    counts = {}
    # every nn.LayerNorm, whatever the architecture names it (ModernBERT's mlp_norm, DistilBERT's sa_layer_norm)
    # and whatever wraps it (PEFT's LN tuning holds the norm it tunes)
    for name, module in model.named_modules():
        weight = module.weight if isinstance(module, torch.nn.LayerNorm) else None
        if weight is not None and not weight.is_meta:  # a model built on the meta device: no weights yet
            whole = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # an FSDP2 shard
            counts[name] = int((whole.detach().abs() < kernel.MIN_WEIGHT).sum())
    return {name: count for name, count in counts.items() if count > kernel.SIDE_COLUMNS}


def choose_layer_norm_backward(model: torch.nn.Module, config: BertConfig, log: bool = True) -> None:
    """Where weights arrive (from_pretrained, from_hf, fastbert.apply, a pretraining resume): set
    config.layer_norm_backward to "input" when a LayerNorm of `model` has more small weights than the
    backward from the output takes, and log it in one line (log=False: the ranks of a distributed run but
    the main one, which all choose alike). Callers skip it when the user set the field."""
    if config.layer_norm_backward == "input":
        return
    unchecked = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is not None
                 and m.weight.is_meta]
    if unchecked and log:
        logger.info("%s: its LayerNorm weights are on the meta device, so they were not checked for small weights, "
                    "nor will be the weights loaded into it later: pass layer_norm_backward='input' where they have "
                    "many weights near zero", type(model).__name__)
    small = small_weight_layer_norms(model)
    if small:
        config.layer_norm_backward = "input"
    if small and log:
        logger.info("%s: %s; layer_norm_backward='input' chosen: each LayerNorm keeps x and the residual for "
                    "its backward, 2 more activations per LayerNorm", type(model).__name__, small_weights_text(small))


def small_weights_text(small: dict[str, int]) -> str:
    """`small` (small_weight_layer_norms) in words: which LayerNorms, how many small weights, the limit."""
    kernel = ops.KERNELS["layer_norm"]
    names = ", ".join(f"{name} ({count})" for name, count in small.items())
    return (f"more than {kernel.SIDE_COLUMNS} weights with |weight| < {kernel.MIN_WEIGHT:g} in LayerNorm {names}, "
            "which the LayerNorm backward from the output cannot recover (NaN gradients)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and what is wrong."""


class SizeMismatchError(CheckpointError, RuntimeError):
    """Tensors whose shapes are not the config's: a RuntimeError too, as transformers raises for them."""


def _checkpoint_files(path: str, use_safetensors: bool | None) -> tuple[list[str], callable]:
    """The weight files of an HF directory (one file, or the shards an index.json names) and their reader."""
    from safetensors.torch import load_file

    formats = [(SAFETENSORS_NAME, load_file),
               (TORCH_NAME, lambda f: torch.load(f, map_location="cpu", weights_only=True))]
    if use_safetensors is not None:
        formats = formats[:1] if use_safetensors else formats[1:]
    for name, reader in formats:
        file = os.path.join(path, name)
        if os.path.exists(file):
            return [file], reader
        index = f"{file}.index.json"
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a valid shard index ({type(exc).__name__}: {exc})") from exc
            return [os.path.join(path, shard) for shard in shards], reader
    names = " or ".join(name for name, _ in formats)
    raise FileNotFoundError(f"no {names} (or a sharded index of either) in {path}")


def read_state_dict(path: str | os.PathLike, use_safetensors: bool | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (single file or sharded), on CPU. A file that cannot be
    read (truncated, not a checkpoint, a missing shard) is a CheckpointError naming it."""
    files, reader = _checkpoint_files(os.fspath(path), use_safetensors)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(reader(file))
        except Exception as exc:  # safetensors, pickle and OS errors all mean: this file is unreadable
            error = CheckpointError(f"{file}: cannot read the weights ({type(exc).__name__}: {exc})")
            error.file = file
            raise error from exc
    return state


def normalize_keys(state: dict[str, torch.Tensor], tied: bool = True) -> dict[str, torch.Tensor]:
    """HF-format keys, whatever the checkpoint's vintage (see the module docstring). `tied`: the decoder
    shares the word embeddings (config.tie_word_embeddings), so its stored copy is dropped."""
    out = {}
    for key, value in state.items():
        if key.endswith(BUFFER_SUFFIXES):
            continue
        if key.endswith(".gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith(".beta"):
            key = key[: -len("beta")] + "bias"
        out[key] = value
    if tied:  # the decoder's copies of the word embeddings and of the head's bias (older checkpoints hold both)
        out.pop("cls.predictions.decoder.weight", None)
        bias = out.pop("cls.predictions.decoder.bias", None)
        if bias is not None:
            out.setdefault("cls.predictions.bias", bias)
    elif "cls.predictions.bias" in out:  # transformers 4 linked the decoder's bias to the head's and saved that one
        out.setdefault("cls.predictions.decoder.bias", out["cls.predictions.bias"])
    return out


def tied_keys(model: torch.nn.Module) -> set[str]:
    """The keys a checkpoint may leave out because they are tied to another (the MLM decoder)."""
    return {*TIED_KEYS, *(getattr(model, "_tied_weights_keys", None) or {})}


def match_prefix(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Add or strip the base model's prefix (`bert.`, `roberta.`, ...) so the checkpoint's keys line up with
    the model's (heads hold their base model under that name)."""
    prefix = getattr(model, "base_model_prefix", "bert") + "."
    model_has_prefix = hasattr(model, prefix[:-1])
    state_has_prefix = any(k.startswith(prefix) for k in state)
    if model_has_prefix and not state_has_prefix:
        return {(prefix + k if k.startswith(BASE_MODULES) else k): v for k, v in state.items()}
    if state_has_prefix and not model_has_prefix:
        return {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def _check_against_model(model: torch.nn.Module, state: dict[str, torch.Tensor], missing: list[str],
                         source: str) -> None:
    """CheckpointError where the weights cannot be the model's config: encoder weights missing (e.g. more
    layers in config.json than in the file), or SizeMismatchError for tensors of other shapes."""
    config = model.config
    prefix = getattr(model, "base_model_prefix", "bert") + "."
    encoder_missing = [k for k in missing if k.removeprefix(prefix).startswith(ENCODER_MODULES)]
    if encoder_missing:
        layer = r"(?:encoder|transformer)\.layer\.(\d+)\."
        layers = sorted({int(m.group(1)) for k in encoder_missing if (m := re.search(layer, k))})
        present = sorted({int(m.group(1)) for k in state if (m := re.search(layer, k))})
        if layers:
            what = (f"config num_hidden_layers={config.num_hidden_layers} but the weights hold "
                    f"{len(present)} layer(s) ({', '.join(map(str, present)) or 'none'}); missing "
                    f"{', '.join(f'encoder.layer.{i}' for i in layers)}")
        else:
            what = f"the weights lack {', '.join(encoder_missing[:6])}{' ...' if len(encoder_missing) > 6 else ''}"
        raise CheckpointError(f"{source}: {what}; the encoder would be left randomly initialised")
    expected = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (the config needs {tuple(expected[k].shape)})"
             for k, v in state.items() if k in expected and v.shape != expected[k].shape]
    if wrong:
        raise SizeMismatchError(f"{source}: tensor shapes do not match the config (hidden_size={config.hidden_size}, "
                                f"vocab_size={config.vocab_size}, intermediate_size={config.intermediate_size}, ...): "
                                f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}; ignore_mismatched_sizes="
                                "True initialises these tensors anew")


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "the checkpoint",
               dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               ignore_mismatched_sizes: bool = False) -> dict[str, set | list]:
    """Load HF-format tensors into a fastbert model; return (and warn about) what did not load, as
    transformers' loading info: {"missing_keys": set, "unexpected_keys": set, "mismatched_keys": set of
    (key, checkpoint shape, model shape), "error_msgs": []}.

    A model built on the meta device (`with torch.device("meta"): Model(config)`) gets the tensors assigned
    (cast to `dtype` and moved to `device` where given): nothing is initialised twice. Weights the
    checkpoint lacks outside the encoder (a new head, a pooler) are materialised and initialised as in
    `__init__`; missing encoder weights raise CheckpointError naming `source`, tensors of other shapes
    SizeMismatchError (a RuntimeError too), or with ignore_mismatched_sizes are initialised as missing ones.
    """
    tied = getattr(model.config, "tie_word_embeddings", True)
    state = match_prefix(normalize_keys(state, tied), model)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not (tied and k in tied_keys(model))]
    unexpected = [k for k in state if k not in expected]
    mismatched = {(k, tuple(v.shape), tuple(expected[k].shape))
                  for k, v in state.items() if k in expected and v.shape != expected[k].shape}
    resized = sorted(key for key, _, _ in mismatched) if ignore_mismatched_sizes else []
    state = {k: v for k, v in state.items() if k not in resized}
    _check_against_model(model, state, missing, source)
    on_meta = any(p.is_meta for p in model.parameters())
    target = device if device is not None else ("cpu" if on_meta else None)
    state = {k: v.to(device=target, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
             for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=on_meta)
    if on_meta:  # new weights (a head, a pooler) take the checkpoint's dtype where it has one, as transformers'
        floating = {v.dtype for v in state.values() if v.is_floating_point()}
        _initialise_missing(model, missing + resized, dtype or (floating.pop() if len(floating) == 1 else None),
                            target)
    for module in model.modules():  # loaded or initialised above: a later post_init re-initialises none of it
        module._is_hf_initialized = True
    model.tie_weights()
    # in transformers' load report's words (MISSING, UNEXPECTED, MISMATCH: "Reinit due to size mismatch - ckpt:
    # ... vs model: ..."), on one line of the fastbert logger where transformers prints a table
    other_sizes = sorted(f"{key} ckpt: {theirs} vs model: {ours}" for key, theirs, ours in mismatched)
    reported = [f"{what} {keys}" for what, keys in (("missing keys (newly initialised)", missing),
                                                     ("unexpected keys (ignored)", unexpected),
                                                     ("mismatched keys (reinit due to size mismatch)", other_sizes))
                if keys]
    if reported:
        logger.warning("%s from %s: %s", type(model).__name__, source, "; ".join(reported))
    return {"missing_keys": set(missing), "unexpected_keys": set(unexpected), "mismatched_keys": mismatched,
            "error_msgs": []}


@torch.no_grad()
def _initialise_missing(model: torch.nn.Module, missing: list[str], dtype, device) -> None:
    """Weights still on the meta device after loading: allocate them and run the model's init on their
    modules (other tensors of such a module keep their loaded values)."""
    by_module: dict[str, list[str]] = {}
    for key in missing:
        owner, _, name = key.rpartition(".")
        by_module.setdefault(owner, []).append(name)
    for owner, names in by_module.items():
        module = model.get_submodule(owner)
        loaded = {n: t.clone() for n, t in module.named_parameters(recurse=False) if n not in names}
        for name in names:
            meta = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(torch.empty_like(meta, device=device, dtype=dtype or meta.dtype),
                                                     requires_grad=meta.requires_grad))
        model._init_weights(module)
        for name, value in loaded.items():
            getattr(module, name).copy_(value)


def _resolve_dtype(kwargs: dict) -> torch.dtype | None:
    """transformers' dtype= / torch_dtype= as a torch dtype; None for "auto" (or none given), which
    load_pretrained reads as transformers does: config.json's dtype, else the weights'."""
    dtype, legacy = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    if dtype is not None and legacy is not None and dtype != legacy:
        raise ValueError(f"dtype={dtype!r} and torch_dtype={legacy!r} disagree; pass one (torch_dtype is its old name)")
    dtype = dtype if dtype is not None else legacy
    if dtype is None or dtype == "auto":
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating torch dtype (e.g. torch.bfloat16, 'float16'), "
                         f"got {dtype!r}")
    return value


def _config_dtype(config) -> torch.dtype | None:
    """config.json's dtype (or torch_dtype, its old name) as a floating torch dtype, or None where it names none."""
    value = getattr(config, "dtype", None)
    value = getattr(torch, value, None) if isinstance(value, str) else value
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _resolve_device(device_map) -> torch.device | None:
    """transformers' device_map=, for the one-device forms fastbert implements."""
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None or isinstance(device_map, (int, torch.device)):
        return None if device_map is None else torch.device(device_map)
    if isinstance(device_map, str) and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        return torch.device(device_map)
    raise ValueError(f"device_map={device_map!r} is not supported: fastbert loads onto one device "
                     "(device_map='cuda', 'cpu', 0 or {'': device}); spread a model with your own tooling")


def load_pretrained(cls, name_or_path, *model_args, config=None, output_loading_info=False, state_dict=None,
                    use_safetensors=None, device_map=None, adapter_kwargs=None, ignore_mismatched_sizes=False,
                    **kwargs):
    """`Model.from_pretrained` (see its docstring)."""
    if torch.get_default_device().type == "meta":  # as transformers refuses it
        raise RuntimeError(f"{cls.__name__}.from_pretrained under a meta device (with torch.device('meta') or "
                           "torch.set_default_device('meta')) would load no weights; build an empty model there "
                           f"with {cls.__name__}(config), or load outside it")
    if model_args:
        raise TypeError(f"{cls.__name__}.from_pretrained takes no positional arguments after the path, got "
                        f"{len(model_args)}; pass config fields as keywords")
    refused = [f"{k} ({UNSUPPORTED_LOADER_ARGUMENTS[k]})" for k in kwargs
               if k in UNSUPPORTED_LOADER_ARGUMENTS and kwargs[k] not in (None, False)]
    if (adapter_kwargs or {}).get("_adapter_model_path"):  # the Auto classes found a PEFT adapter there
        refused.append("a PEFT adapter checkpoint (load the base model, then the adapter with peft)")
    if refused:
        raise ValueError(f"{cls.__name__}.from_pretrained does not implement {'; '.join(refused)}")
    for key in (*IGNORED_LOADER_ARGUMENTS, *UNSUPPORTED_LOADER_ARGUMENTS):
        kwargs.pop(key, None)
    dtype = _resolve_dtype(kwargs)
    device = _resolve_device(device_map)
    built = {}  # the model's own arguments transformers' from_pretrained passes on (BertModel's add_pooling_layer)
    if "add_pooling_layer" in kwargs:
        if not takes_add_pooling_layer(cls):
            raise TypeError(f"{cls.__name__}.from_pretrained got add_pooling_layer, which {cls.__name__} does not take")
        built["add_pooling_layer"] = kwargs.pop("add_pooling_layer")
    if name_or_path is None and (config is None or state_dict is None):  # transformers' path-less form
        raise ValueError(f"{cls.__name__}.from_pretrained(None, ...) needs config= and state_dict=, got "
                         f"config={type(config).__name__}, state_dict={type(state_dict).__name__}")
    hub_arguments = {k: kwargs.pop(k) for k in hub.HUB_ARGUMENTS if k in kwargs}
    path = None if name_or_path is None else hub.resolve(name_or_path, **hub_arguments)
    if config is None:
        config = cls.config_class.from_json(path)
    elif not isinstance(config, cls.config_class):
        raise TypeError(f"config must be a fastbert.{cls.config_class.__name__}, got {type(config).__name__}")
    else:
        config = config.replace()
    config.update_known(kwargs, f"{cls.__name__}.from_pretrained")
    source = "the state_dict given" if path is None else os.path.join(path, "config.json") + " and its weights"
    if state_dict is None:
        state_dict = read_state_dict(path, use_safetensors)
    if dtype is None:  # "auto", as transformers reads it: config.json's dtype, else the weights' own
        dtype = _config_dtype(config)
    with torch.device("meta"):
        model = cls(config, **built)
    info = load_state(model, state_dict, source, dtype, device, ignore_mismatched_sizes)
    floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if floating is not None:
        model.config.dtype = floating  # what the model holds, as transformers' loader records it
    if "layer_norm_backward" not in kwargs:
        choose_layer_norm_backward(model, model.config)
    model.config.name_or_path = model.name_or_path = "" if name_or_path is None else os.fspath(name_or_path)
    model.eval()  # as transformers: a loaded model starts in eval mode (dropout off)
    return (model, info) if output_loading_info else model


def hf_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors (or `state`) under HF's names, each storage once (the tied decoder left out),
    contiguous and on CPU."""
    state = model.state_dict() if state is None else state
    seen, out = set(), {}
    for key, value in state.items():
        value = value.detach()
        if key in tied_keys(model) and getattr(model.config, "tie_word_embeddings", True):
            continue
        identity = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
        if identity in seen:  # another name for a tensor already written (a tie)
            continue
        seen.add(identity)
        out[key] = value.to("cpu").contiguous()
    return out


def _shard_bytes(max_shard_size) -> int | None:
    """transformers' max_shard_size: bytes, or a string such as "5GB" / "500MB"."""
    if max_shard_size is None or isinstance(max_shard_size, int):
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(max_shard_size), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"max_shard_size must be bytes or a size like '5GB', got {max_shard_size!r}")
    unit = match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** ("KMG".index(unit[0]) + 1))


def _shards(state: dict[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    return shards


def save_pretrained(model: torch.nn.Module, path, is_main_process: bool = True, state_dict=None,
                    safe_serialization: bool = True, max_shard_size=None, **kwargs) -> None:
    """config.json + weights, loadable by transformers' from_pretrained unchanged: model.safetensors
    (pytorch_model.bin without safe_serialization), or shards and an index.json past max_shard_size.

    Files are written to partial names and renamed once all are written (fastbert.files.replaced_files), so
    an interrupted save leaves the previous files and no partial ones; a failed write (a full disk) is a
    fastbert.files.WriteError (an OSError) naming `path` and the space the weights need.
    """
    from safetensors.torch import save_file

    refused = [f"{k} ({UNSUPPORTED_SAVE_ARGUMENTS[k]})" for k, v in kwargs.items()
               if k in UNSUPPORTED_SAVE_ARGUMENTS and v not in (None, False)]
    unknown = [k for k in kwargs if k not in UNSUPPORTED_SAVE_ARGUMENTS and k != "token"]
    if refused or unknown:
        raise ValueError(f"save_pretrained does not implement {'; '.join(refused + unknown)}")
    if not is_main_process:
        return
    os.makedirs(path, exist_ok=True)
    values = model.config.config_json()
    values["architectures"] = [type(model).__name__]
    values["dtype"] = str(model.dtype).removeprefix("torch.")
    values.pop("transformers_version", None)  # the writer's version, as transformers records it
    if HAVE_TRANSFORMERS:
        import transformers
        values["transformers_version"] = transformers.__version__
    tensors = hf_state_dict(model, state_dict)
    base = SAFETENSORS_NAME if safe_serialization else TORCH_NAME
    shards = _shards(tensors, _shard_bytes(max_shard_size))
    names = [base] if len(shards) == 1 else [
        base.replace(".", f"-{i + 1:05d}-of-{len(shards):05d}.", 1) for i in range(len(shards))]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    files = [os.path.join(path, name) for name in names]
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        files.append(os.path.join(path, base + ".index.json"))
    files.append(os.path.join(path, "config.json"))
    with replaced_files(files, total, name=path) as partials:
        for partial, shard in zip(partials, shards):
            if safe_serialization:
                save_file(shard, partial, metadata={"format": "pt"})
            else:  # through a Python file: a failed write is an OSError with its errno behind torch's RuntimeError
                with open(partial, "wb") as f:
                    torch.save(shard, f)
        if len(shards) > 1:
            _write_json(index, partials[-2])
        _write_json(values, partials[-1])
    _remove_earlier_weights(path, {os.path.basename(file) for file in files})


# the weight files of a save: one file, shards, their index; safetensors or pickled
WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _remove_earlier_weights(path: str, kept: set[str]) -> None:
    """Remove the weight files an earlier save left in `path` that this one did not write (as transformers removes
    old shards): a model.safetensors left beside a new index would be the one loaders read (they take the single
    file first), and old shards would lie beside the index that no longer names them."""
    for name in os.listdir(path):
        if name not in kept and WEIGHT_FILE.fullmatch(name) and os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))


def _write_json(values: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("to_hf needs transformers: pip install 'fastbert[hf]'") from exc
    return transformers


def pooler_argument(model_class: type, source) -> dict:
    """{"add_pooling_layer": whether `source` (a model of either library) has a pooler} where model_class takes the
    argument, else {}: a base model built without its pooler is copied without one."""
    if not takes_add_pooling_layer(model_class):
        return {}
    return {"add_pooling_layer": getattr(source, "pooler", None) is not None}


def takes_add_pooling_layer(model_class: type) -> bool:
    """Whether model_class is a base model built with or without its pooler (BertModel, RobertaModel)."""
    return "add_pooling_layer" in inspect.signature(model_class).parameters


def to_hf(model):
    """The same model as a transformers object with identical weights (class chosen by name)."""
    transformers = _require_transformers()
    hf_class = getattr(transformers, type(model).__name__)
    values = model.config.to_dict()
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    hf_model = hf_class(hf_config, **pooler_argument(hf_class, model))
    result = hf_model.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in result.missing_keys if k not in tied_keys(model)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"to_hf: missing {missing}, unexpected {result.unexpected_keys}")
    if hasattr(hf_model, "tie_weights"):
        hf_model.tie_weights()
    reference = next(model.parameters())
    hf_model.to(device=reference.device, dtype=reference.dtype)
    return hf_model.train(model.training)
