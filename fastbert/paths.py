"""Which implementation of a fused op backend="auto" runs on a GPU: the one measured fastest there.

Every fused op has its Triton kernel and a PyTorch path of the same job; on CUDA tensors "auto" runs the one
the GPU suite measured faster at the op's shape class, on the nearest measured GPU architecture, from the
committed table `fastbert/paths.json` (or the table the environment variable FASTBERT_PATHS names). The
implementations:
- "triton": the op's Triton kernel (fastbert.kernels), what backend="triton" runs.
- "torch": the pure-PyTorch reference (fastbert.reference: cuBLAS's GEMMs, SDPA, PyTorch's LayerNorm and
  GELU), what backend="torch" runs.
- "cublas_then_bias_gelu" (linear_bias_gelu, feed_forward, feed_forward_geglu): cuBLAS's GEMM, then the Triton
  bias + GELU (GeGLU) kernel; the FFNs keep their Triton backward and its saves (kernels/ffn.py's `form`).
- "cublas_forward" (qkv_projection): PyTorch's forward (cuBLAS's GEMM with its bias, then views), the kernel's
  backward, which reads attention's gradients where they are instead of autograd's stack of them
  (kernels/qkv.py). Inside the attention sublayer's one autograd node (fastbert/sublayer.py) "torch" runs this
  form too: there dq, dk and dv are always attention's one buffer, and the backward's GEMMs are PyTorch's own.
Attention's PyTorch path is SDPA, a candidate only without a mask, a relative bias, rotary positions or a
window (ops.attention passes no op otherwise, and the kernel runs).

Candidates (CANDIDATES): "auto" never trades the memory a training step keeps for speed. Only implementations
that keep for the backward what the kernel keeps compete: the QKV projection's cuBLAS paths (x and the weights),
SDPA's flash and cuDNN kernels (q, k, v, the output and its log-sum-exp), PyTorch's gelu(x + bias) (the
pre-activation) and the FFNs' cuBLAS form (its Triton backward and saves). The LayerNorm's PyTorch path keeps
its input, a dropout mask and, under autocast, an fp32 residual stream (about twice a layer's activations);
the FFN's keeps the GELU output too; the MLM loss's reference runs chunked in Python. Those run only where
asked for (backend="torch"), and their Triton kernels are what must be made fast.

Shape classes. Each size of an op rounds down to a half-octave, the largest 2^k or 1.5 x 2^k at most the size
(768 -> 768, 1000 -> 768, 1100 -> 1024, 16384 -> 16384). The sizes per op (SIZES):
  layer_norm            tokens (rows), hidden
  bias_gelu             tokens, features
  linear_bias_gelu      tokens, hidden (K), intermediate (N; the GeGLU's 2I): also the FFNs' class, as their
                        up-projection is the only part their paths run differently
  qkv_projection        tokens (B x S, or T packed), hidden
  attention             tokens (B x S), seqlen, head_dim
  linear_cross_entropy  tokens (the labelled rows), hidden, vocab
plus the dtype the op computes in (the autocast dtype for matmul-type ops) and whether a backward follows
(grad enabled and an input that requires grad: the suite's forward + backward time decides, else its forward
time). A size that is symbolic (torch.compile with dynamic shapes) is left out of the comparison rather than
specialised on.

Missing measurements: a class without rows takes the nearest measured class of the op (fewest half-octave steps
summed over its sizes; a tie goes to the class larger in its first differing size, in the order above); a dtype without rows, its 16-bit sibling's (bf16 <->
fp16), else the kernel; an op without rows, the kernel; an architecture without rows (compute capability, e.g.
sm_89), the nearest measured one (a tie goes to the older). The choice is cached per (device capability, op,
dtype, direction, shapes): a call costs the host a tuple and a dict lookup; an op with one candidate (the
LayerNorm, the MLM loss) is not looked up at all.

Inside a memory plan meta tensors stand for the planned GPU's tensors (`planned_architecture`), so a plan of
"auto" plans the paths that GPU would run. The table is written by `python benchmarks/choose_paths.py` from
the GPU suite's rows (fastbert.bench.path_table); PERF.md shows it.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from fastbert.kernels.fused_op import backward_follows

IMPLEMENTATIONS = ("triton", "torch", "cublas_then_bias_gelu", "cublas_forward")
# op -> the implementations "auto" may choose (the docstring's Candidates); the first is the default
CANDIDATES = {
    "layer_norm": ("triton",),
    "bias_gelu": ("triton", "torch"),
    "linear_bias_gelu": ("triton", "cublas_then_bias_gelu"),  # also the FFNs' choice: its reference keeps more
    "qkv_projection": ("triton", "torch", "cublas_forward"),
    "attention": ("triton", "torch"),
    "linear_cross_entropy": ("triton",),
}
# op -> its implementation where "auto" has nothing to choose (one candidate; `load` refuses a table that names
# another): resolve_backend returns it without reading shapes or the table, on every call of those ops
ONLY_CANDIDATE = {op: candidates[0] for op, candidates in CANDIDATES.items() if len(candidates) == 1}
# the table "auto" reads, once at import: the committed one, or the file FASTBERT_PATHS names (a table of your GPU's
# own rows: `python benchmarks/choose_paths.py --results DIR --out FILE`; benchmarks/gpu_check.sh uses one so that
# its model rows run the paths its op rows chose)
COMMITTED_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paths.json")
TABLE_PATH = os.environ.get("FASTBERT_PATHS") or COMMITTED_TABLE_PATH
DIRECTIONS = ("fwd", "fwd+bwd")  # the suite's row directions the choice reads: inference, training


def _tokens_and_last(x, *_):
    last = x.shape[-1]
    return x.numel() // max(last, 1), last


def _matmul_sizes(x, weight, *_):
    return (*_tokens_and_last(x), weight.shape[0])


# op -> (size names, sizes(*tensors as ops.py hands them to resolve_backend))
SIZES = {
    "layer_norm": (("tokens", "hidden"), _tokens_and_last),
    "bias_gelu": (("tokens", "features"), _tokens_and_last),
    "linear_bias_gelu": (("tokens", "hidden", "intermediate"), _matmul_sizes),
    "qkv_projection": (("tokens", "hidden"), _tokens_and_last),
    "attention": (("tokens", "seqlen", "head_dim"), lambda q, *_: (q.shape[0] * q.shape[2], q.shape[2], q.shape[3])),
    "linear_cross_entropy": (("tokens", "hidden", "vocab"), lambda x, weight, *_: (*x.shape, weight.shape[0])),
}
# ops that read another op's rows (their tensors come in the same order)
TABLE_OP = {"feed_forward": "linear_bias_gelu", "feed_forward_geglu": "linear_bias_gelu"}
SIXTEEN_BIT_SIBLING = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def half_octave(size: int) -> int:
    """The bucket of a size: 2k for 2^k <= size < 1.5 x 2^k, 2k + 1 for 1.5 x 2^k <= size < 2^(k+1); 0 below 2."""
    k = size.bit_length() - 1
    return 2 * k + ((size >> (k - 1)) & 1) if k > 0 else 0


def bucket_floor(size: int) -> int:
    """The least size of size's half-octave: the size a class names (1000 -> 768)."""
    k, upper = divmod(half_octave(size), 2)
    return 3 << (k - 1) if upper else 1 << k


def class_name(op: str, sizes) -> str:
    """The table's name of the class of these sizes of op (its SIZES order), e.g. 'tokens=16384,hidden=768'."""
    names, _ = SIZES[TABLE_OP.get(op, op)]
    return ",".join(f"{name}={bucket_floor(int(size))}" for name, size in zip(names, sizes))


def buckets(sizes) -> tuple:
    """The half-octave of each size; a symbolic size (dynamic shapes under torch.compile) gets None: the
    comparison leaves it out rather than specialise the compiled code on it."""
    return tuple(half_octave(s) if type(s) is int else None for s in sizes)


def load(path: str = TABLE_PATH) -> dict:
    """The table as lookups use it: {capability: {(op, dtype, direction): [(buckets, implementation), ...]}},
    each list with the larger classes first. Raises ValueError naming an unknown implementation or op."""
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    index: dict[int, dict] = {}
    for arch, entry in table["architectures"].items():
        by_key = index.setdefault(int(arch.removeprefix("sm_")), {})
        for op, classes in entry["ops"].items():
            if op not in SIZES:
                raise ValueError(f"{path}: op {op!r} is not one of {tuple(SIZES)}")
            for name, dtypes in classes.items():
                measured_buckets = buckets(int(pair.split("=")[1]) for pair in name.split(","))
                for dtype, directions in dtypes.items():
                    for direction, measured in directions.items():
                        if measured["chosen"] not in CANDIDATES[op]:
                            raise ValueError(f"{path}: {arch} {op} {name} chooses {measured['chosen']!r}, "
                                             f"not one of its candidates {CANDIDATES[op]}")
                        by_key.setdefault((op, getattr(torch, dtype), direction), []).append(
                            (measured_buckets, measured["chosen"]))
    for by_key in index.values():
        for choices in by_key.values():
            choices.sort(key=lambda choice: choice[0], reverse=True)
    return index


# Read at import: dispatch runs inside torch.compile's traced code, which cannot read a file.
def _table_in_effect() -> dict:
    """load(TABLE_PATH), with an error that names FASTBERT_PATHS where that names no file."""
    try:
        return load(TABLE_PATH)
    except FileNotFoundError:
        if TABLE_PATH == COMMITTED_TABLE_PATH:
            raise
        raise FileNotFoundError(f"FASTBERT_PATHS is {TABLE_PATH!r}, which is no file; unset it for the committed "
                                f"table ({COMMITTED_TABLE_PATH})") from None


TABLE = _table_in_effect()
_CHOSEN: dict[tuple, str] = {}  # (capability, op, dtype, training, input shape, second shape) -> implementation
CACHE_ENTRIES = 4096
_CAPABILITY: dict[int, int] = {}  # CUDA device index -> compute capability (90 for sm_90)
_PLANNED: list[int | None] = [None]  # the capability meta tensors stand for, inside planned_architecture
_RECORDING: list[dict | None] = [None]  # (op, direction) -> implementation, inside recorded_choices


def lookup(table: dict, capability: int, op: str, dtype: torch.dtype, direction: str, classed: tuple) -> str:
    """The implementation `table` (a `load` result) chooses for a class (`buckets` of its sizes); the
    fallbacks of the module docstring. Plain loops: torch.compile traces this (min's key= it does not)."""
    nearest = None
    for measured in table:
        if nearest is None or (abs(measured - capability), measured) < (abs(nearest - capability), nearest):
            nearest = measured
    if nearest is None:
        return "triton"
    by_key = table[nearest]
    choices = by_key.get((op, dtype, direction)) or by_key.get((op, SIXTEEN_BIT_SIBLING.get(dtype), direction))
    implementation, least = "triton", None
    for measured_buckets, chosen in choices or ():  # larger classes first: they win a tie
        distance = 0
        for a, b in zip(measured_buckets, classed):
            if b is not None:
                distance += abs(a - b)
        if least is None or distance < least:
            implementation, least = chosen, distance
    return implementation


def choose(op: str, tensors, dtype: torch.dtype, capability: int) -> str:
    """The implementation of op ("feed_forward" reads linear_bias_gelu's rows) for these tensors (as ops.py
    hands them to resolve_backend: the op's input, then a second tensor, then any), computing in dtype, on a
    GPU of this compute capability (90 for sm_90)."""
    first = tensors[0]
    training = backward_follows(tensors)
    if torch.compiler.is_compiling():  # traced once: no cache, and no specialising on a symbolic shape's key
        return _lookup_sizes(op, tensors, dtype, capability, training)
    # the two leading shapes fix every size of every op's class: no arithmetic on a hit
    key = (capability, op, dtype, training, first.shape, tensors[1].shape)
    implementation = _CHOSEN.get(key)
    if implementation is None:
        if len(_CHOSEN) >= CACHE_ENTRIES:  # packed inputs bring a new token count each batch
            _CHOSEN.clear()
        implementation = _CHOSEN[key] = _lookup_sizes(op, tensors, dtype, capability, training)
        if _RECORDING[0] is not None:
            _record(_RECORDING[0], op, DIRECTIONS[training], implementation)
    return implementation


def _lookup_sizes(op, tensors, dtype, capability, training) -> str:
    op = TABLE_OP.get(op, op)
    return lookup(TABLE, capability, op, dtype, DIRECTIONS[training], buckets(SIZES[op][1](*tensors)))


def device_capability(device: torch.device) -> int:
    """A CUDA device's compute capability as one number (90 for sm_90), cached per device."""
    capability = _CAPABILITY.get(device.index)
    if capability is None:
        properties = torch.cuda.get_device_properties(device)
        capability = _CAPABILITY[device.index] = 10 * properties.major + properties.minor
    return capability


def recorded_choice(choices, op: str, tensors) -> str:
    """The implementation of op that `choices` (a `recorded_choices` table) holds for the direction these tensors
    take: what backend="auto" runs on the CPU tensors of a host-time measurement standing for a GPU's
    (fastbert.ops.set_stubbed_auto). Raises ValueError where it holds none: the call is not the one recorded."""
    direction = DIRECTIONS[backward_follows(tensors)]
    implementation = choices.get((op, direction))
    if implementation is None:
        raise ValueError(f"no recorded choice of backend='auto' for op {op} ({direction}): the call differs from "
                         f"the one whose choices were recorded ({sorted(choices)})")
    return implementation


def _record(recorded: dict, op: str, direction: str, implementation: str) -> None:
    if recorded.setdefault((op, direction), implementation) != implementation:
        raise ValueError(f"backend='auto' ran op {op} ({direction}) as both {recorded[op, direction]!r} and "
                         f"{implementation!r}: no one choice stands for it")


@contextlib.contextmanager
def recorded_choices():
    """Records what `choose` chooses while entered: yields a dict (op, direction) -> implementation, filled as each
    choice is made (the choice cache is emptied on entry, so that a choice made before is looked up again). Raises
    ValueError where one op in one direction is given two implementations (two of its shape classes that the table
    answers differently): such a call has no one choice to stand for. Under torch.compile `choose` looks up
    without its cache, and records nothing."""
    if _RECORDING[0] is not None:
        raise RuntimeError("recorded_choices is already entered")
    _CHOSEN.clear()
    recorded = _RECORDING[0] = {}
    try:
        yield recorded
    finally:
        _RECORDING[0] = None


def planned_capability() -> int | None:
    """The compute capability meta tensors stand for now (inside `planned_architecture`), else None."""
    return _PLANNED[0]


@contextlib.contextmanager
def planned_architecture(capability: int):
    """While entered, meta tensors stand for the tensors of a GPU of this compute capability (a memory plan):
    backend="auto" chooses on them what it would on that GPU."""
    previous, _PLANNED[0] = _PLANNED[0], capability
    try:
        yield
    finally:
        _PLANNED[0] = previous
