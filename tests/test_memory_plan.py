"""The memory plan (fastbert.simulated.memory_plan, meta_gpu): the autocast emulation against the real autocast,
a plan through the real launchers against the bytes each op saves, and the plan's argument checks."""
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastbert import BertConfig
from fastbert.simulated.memory_plan import plan_step
from fastbert.simulated.memory_tracker import MemoryTracker
from fastbert.simulated.meta_gpu import CPU_AUTOCAST, CUDA_AUTOCAST, AutocastEmulation, planned_gpu
from fastbert.modeling import BertForPreTraining

transformers = pytest.importorskip("transformers")


def _hf_pretraining(config: BertConfig, attention: str):
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings)
    hf_config._attn_implementation = attention
    return transformers.BertForPreTraining(hf_config)


def _pretraining_batch(config: BertConfig, rows: int, seqlen: int, device="cpu") -> dict:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(5, config.vocab_size, (rows, seqlen), generator=generator)
    labelled = torch.rand(rows, seqlen, generator=generator) < 0.15
    batch = {"input_ids": torch.randint(5, config.vocab_size, (rows, seqlen), generator=generator),
             "attention_mask": torch.ones(rows, seqlen, dtype=torch.long),
             "token_type_ids": torch.zeros(rows, seqlen, dtype=torch.long),
             "labels": torch.where(labelled, labels, -100),
             "next_sentence_label": torch.zeros(rows, dtype=torch.long)}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def _forward(model, batch, region):
    """(bytes saved for the backward, peak bytes, dtype of each output tensor) of a forward in `region`."""
    with MemoryTracker([model], inputs=batch.values()) as tracker:
        with region:
            output = model(**batch)
        tracker.mark("forward end")
    dtypes = {name: value.dtype for name, value in output.items() if isinstance(value, torch.Tensor)}
    return tracker.snapshot("forward end").categories["activations"], tracker.peak_bytes, dtypes


@pytest.mark.parametrize("provider", ["fastbert", "transformers-eager", "transformers-sdpa"])
def test_autocast_emulation_saves_what_autocast_saves(provider, one_thread):
    """The mechanism that emulates CUDA autocast on meta tensors, run with PyTorch's CPU lists on CPU
    tensors, casts exactly as torch.autocast("cpu") does: the same output dtypes, the same bytes saved for
    the backward and the same peak (fp32 saves other bytes, so the comparison can fail)."""
    torch.manual_seed(0)
    config = BertConfig.tiny(backend="torch")
    model = BertForPreTraining(config) if provider == "fastbert" else _hf_pretraining(config, provider.split("-")[1])
    batch = _pretraining_batch(config, 4, 32)
    autocast = _forward(model, batch, torch.autocast("cpu", dtype=torch.bfloat16))
    emulated = _forward(model, batch, AutocastEmulation(CPU_AUTOCAST, "cpu", torch.bfloat16))
    fp32 = _forward(model, batch, torch.autocast("cpu", enabled=False))
    assert emulated == autocast
    assert fp32[0] != autocast[0]


def _autocast_header_list(macro: str) -> set[str]:
    """The op names of one AT_FORALL_* list in the autocast header that ships with this torch."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    text = header.read_text()
    body = text[text.index(f"#define {macro}(_)"):]
    body = body[:body.index("\n\n")]
    return set(re.findall(r"_\((\w+)", body))


def test_the_cuda_table_is_the_installed_torchs():
    """CUDA_AUTOCAST holds the lists of the autocast header of the torch that runs (plus the cuDNN
    convolutions that autocast_mode.cpp registers beside them), so a torch that changes them fails here."""
    assert CUDA_AUTOCAST.lower_precision_fp == _autocast_header_list("AT_FORALL_LOWER_PRECISION_FP") | {
        "cudnn_convolution", "cudnn_convolution_transpose"}
    assert CUDA_AUTOCAST.fp32 == _autocast_header_list("AT_FORALL_FP32")
    assert CUDA_AUTOCAST.fp32_set_opt_dtype == _autocast_header_list("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert CUDA_AUTOCAST.promote == _autocast_header_list("AT_FORALL_PROMOTE")


def test_sdpa_on_the_planned_gpu_saves_what_its_gpu_backends_save():
    """F.scaled_dot_product_attention on meta takes the math path, which keeps the [B, heads, S, S]
    probabilities; on the planned GPU it is the flash op (no mask: its output, log-sum-exp and Philox state,
    a [2] and a [] uint64) or, with a mask, the memory-efficient op, which also keeps the additive mask."""
    rows, heads, seqlen, head_dim = 2, 4, 64, 32
    q, k, v = (torch.empty(rows, heads, seqlen, head_dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = torch.ones(rows, 1, seqlen, seqlen, dtype=torch.bool, device="meta")

    def saved(attn_mask, planned: bool) -> int:
        with planned_gpu() if planned else contextlib.nullcontext():
            with MemoryTracker(inputs=[q, k, v, mask]) as tracker:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
                tracker.mark("forward end")
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        return tracker.snapshot("forward end").categories["activations"]

    out, lse, philox = 2 * rows * heads * seqlen * head_dim, 4 * rows * heads * seqlen, 8 * 3
    assert saved(None, planned=True) == out + lse + philox
    assert saved(mask, planned=True) == out + lse + 2 * rows * seqlen * seqlen + 2 * 8  # bias, seed and offset
    assert saved(None, planned=False) >= 2 * rows * heads * seqlen * seqlen


def test_plan_step_checks_its_arguments():
    config = BertConfig.tiny(backend="torch")
    with torch.device("meta"):
        model = BertForPreTraining(config)
    batch = _pretraining_batch(config, 2, 16, device="meta")
    with pytest.raises(ValueError, match="mode must be one of \\('train', 'inference'\\), got 'eval'"):
        plan_step(model, batch, mode="eval")
    with pytest.raises(ValueError, match="optimizer must be one of \\(None, 'adamw', 'lamb'\\), got 'sgd'"):
        plan_step(model, batch, optimizer="sgd")
    with pytest.raises(ValueError, match="precision must be one of .*got 'fp16'"):
        plan_step(model, batch, precision="fp16")
    with pytest.raises(ValueError, match="input_ids is on cpu, expected the meta device"):
        plan_step(model, {**batch, "input_ids": torch.zeros(2, 16, dtype=torch.long)})


def test_held_tensors_count_as_inputs_and_nothing_else():
    """A tensor the caller holds beside the batch (an input one model drops and another reads) adds its bytes to
    the inputs, the peak and the forward's end, exactly; one off the meta device is refused by name."""
    config = BertConfig.tiny(backend="torch")
    with torch.device("meta"):
        model = BertForPreTraining(config)
    batch = _pretraining_batch(config, 2, 16, device="meta")
    mask = batch.pop("attention_mask")
    alone, holding = plan_step(model, batch), plan_step(model, batch, held=[mask])
    size = mask.numel() * mask.element_size()
    assert holding.peak_breakdown["inputs"] - alone.peak_breakdown["inputs"] == size > 0
    assert (holding.peak_bytes - alone.peak_bytes, holding.forward_end_bytes - alone.forward_end_bytes) == (size, size)
    assert holding.saved_for_backward_bytes == alone.saved_for_backward_bytes
    with pytest.raises(ValueError, match="held\\[0\\] is on cpu, expected the meta device"):
        plan_step(model, batch, held=[torch.ones(2, 16)])


def test_the_triton_path_is_not_planned_in_the_interpreter():
    """Under TRITON_INTERPRET=1 (this process) the kernels are interpreted ones, which read data: a plan of
    the Triton path says so instead of failing inside Triton."""
    config = BertConfig.tiny(backend="triton", max_predictions_per_seq=3)
    with torch.device("meta"):
        model = BertForPreTraining(config)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 made the kernels interpreted ones"):
        plan_step(model, _pretraining_batch(config, 2, 16, device="meta"))


# A plan in a process of its own: without TRITON_INTERPRET, so that the kernels are compiled-kernel ones and
# their launchers run on meta tensors through the stand-in driver. It reports which kernels Triton was asked
# for, whether any was compiled, and the choices the attention's autotuners kept after the plan.
_PLAN_THROUGH_THE_LAUNCHERS = """
import json, sys
import torch
from triton.runtime.jit import JITFunction
from fastbert import BertConfig
from fastbert.simulated.memory_plan import plan_step
from fastbert.modeling import BertForPreTraining

asked, compiled = set(), []
do_compile = JITFunction._do_compile
def counting(self, *args, **kwargs):
    kernel = do_compile(self, *args, **kwargs)
    asked.add(self.__name__)
    compiled.append(kernel is not None)
    return kernel
JITFunction._do_compile = counting

config = BertConfig.tiny(**json.loads(sys.argv[1]))
rows, seqlen = json.loads(sys.argv[2])
with torch.device("meta"):
    model = BertForPreTraining(config)
batch = {"input_ids": torch.zeros(rows, seqlen, dtype=torch.long),
         "attention_mask": torch.ones(rows, seqlen, dtype=torch.long),
         "token_type_ids": torch.zeros(rows, seqlen, dtype=torch.long),
         "labels": torch.zeros(rows, seqlen, dtype=torch.long),
         "next_sentence_label": torch.zeros(rows, dtype=torch.long)}
plan = plan_step(model, {k: v.to("meta") for k, v in batch.items()}, optimizer="adamw", precision="bf16")
from triton.runtime.autotuner import Autotuner
from fastbert.kernels import attention
tuned = sum(len(tuner.cache) for tuner in vars(attention).values() if isinstance(tuner, Autotuner))
print(json.dumps({"saved": plan.saved_for_backward_bytes, "asked": sorted(asked), "compiled": any(compiled),
                  "phase_of_peak": plan.phase_of_peak, "tuned": tuned}))
"""


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_plan_through_the_launchers_saves_what_each_op_saves(checkpointing):
    """A tiny BertForPreTraining on the Triton path, bf16 autocast, dropout 0.1: the launchers run on meta
    tensors (the stand-in driver compiles nothing), and the bytes saved for the backward are the sum of
    what each op saves, counted here from the ops' documented saves. With full activation checkpointing a
    layer keeps its bf16 input alone, and the backward recomputes it under the forward's autocast (as
    torch.utils.checkpoint does on a GPU; recomputed in fp32 it raised CheckpointError)."""
    rows, seqlen, layers, budget = 2, 32, 2, 5
    options = {"backend": "triton", "num_hidden_layers": layers, "max_predictions_per_seq": budget,
               "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
               "activation_checkpointing": checkpointing}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _PLAN_THROUGH_THE_LAUNCHERS, json.dumps(options),
                             json.dumps([rows, seqlen])], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.splitlines()[-1])
    assert not plan["compiled"]
    assert plan["tuned"] == 0  # a plan's choices (every config timed alike) are not left to a GPU run
    for kernel in ("_attention_fwd_kernel", "_attention_bwd_kernel", "_layer_norm_fwd_kernel",
                   "_layer_norm_bwd_kernel", "_mlm_loss_fwd_kernel", "_mlm_loss_merge_kernel", "_mlm_loss_bwd_kernel"):
        assert kernel in plan["asked"]
    config = BertConfig.tiny()
    hidden, intermediate, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    tokens, labelled = rows * seqlen, rows * budget
    bf16, fp32, int64, seed = 2, 4, 8, 8  # a dropout seed: one int64
    # kernels/layer_norm.py: the output, the side buffer (xhat of 8 small-weight columns) and 1/std per row
    layer_norm = bf16 * tokens * hidden + fp32 * tokens + fp32 * tokens * 8
    embeddings = (int64 * seqlen  # the position ids, for the embedding's backward
                  + layer_norm + seed  # the LayerNorm, then a dropout that keeps its seed
                  + bf16 * tokens * hidden)  # the dropout's output, the QKV projection's input in layer 0
    layer = (3 * bf16 * tokens * hidden  # q, k, v (the projection's output, the attention's input)
             + bf16 * tokens * hidden + fp32 * rows * heads * seqlen + seed  # attention output, log-sum-exp
             + layer_norm + seed  # LayerNorm(dropout(dense(attention output)) + hidden)
             + bf16 * tokens * intermediate  # the FFN's pre-activation (not its GELU output)
             + layer_norm + seed)  # LayerNorm(dropout(FFN) + attended): the layer's output
    if checkpointing == "full":  # the layer's input (layer 0's is the embeddings'); the last output: the pooler's
        layer = bf16 * tokens * hidden
    pooler = bf16 * rows * hidden  # tanh's output (the NSP Linear's input too)
    mlm = (2 * int64 * labelled  # the labelled positions and their targets
           + 3 * bf16 * labelled * hidden  # the gathered rows, the transform's pre-activation, its LayerNorm
           + fp32 * labelled * (1 + 8)  # that LayerNorm's 1/std and side buffer
           + fp32 * (2 * labelled + 1))  # the loss's per-row statistics and its count of labelled rows
    nsp = bf16 * rows * 2 + fp32 * rows * 2 + fp32  # log_softmax (bf16), nll_loss's fp32 copy, total weight
    assert plan["saved"] == embeddings + layers * layer + pooler + mlm + nsp
    assert plan["phase_of_peak"] == "backward"



# A plan of a memory case's fastbert model in a process of its own (the kernels compiled-kernel ones, as above),
# with fastbert.paths' lookup replaced: one that answers `chosen` per op (else the kernel) and records the
# architecture it is asked for. argv: [backend, chosen] of each plan, in order.
_PLAN_FOLLOWS_THE_CHOICE = """
import json, sys
import torch
from fastbert import BertConfig, paths
from fastbert.bench import memory_cases
from fastbert.simulated.memory_plan import plan_step

asked, chosen = set(), {}
def lookup(table, capability, op, dtype, direction, classed):
    asked.add(capability)
    return chosen.get(op, "triton")
paths.lookup = lookup

case = memory_cases.MemoryCase("pretrain", "tiny", 32, 2, "adamw", config=BertConfig.tiny(num_hidden_layers=2))
saved = []
for backend, plan_choices in json.loads(sys.argv[1]):
    chosen.clear()
    chosen.update(plan_choices)
    paths._CHOSEN.clear()
    model = memory_cases.build_model(case, "fastbert")
    model.config.backend = backend
    saved.append(plan_step(model, memory_cases.make_inputs(case, 2), optimizer="adamw",
                           precision="bf16").saved_for_backward_bytes)
backend = memory_cases.build_model(case, "fastbert").config.backend
print(json.dumps({"saved": saved, "asked": sorted(asked), "backend": backend}))
"""


def test_the_memory_plan_plans_the_paths_auto_chooses_on_the_planned_gpu():
    """A memory case plans fastbert with backend "auto", which in a plan chooses as on the planned H100 (sm_90):
    with every op choosing its kernel the plan is the explicit Triton path's, and a table choosing the FFN's
    PyTorch path (which keeps the GELU output besides the pre-activation) plans more saved bytes. The LayerNorm
    has one candidate, so "auto" never looks it up: a lookup answering PyTorch's (which a committed table cannot
    hold) leaves the plan as it is."""
    plans = [["auto", {}], ["triton", {}], ["auto", {"layer_norm": "torch"}], ["auto", {"linear_bias_gelu": "torch"}]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _PLAN_FOLLOWS_THE_CHOICE, json.dumps(plans)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.splitlines()[-1])
    auto_triton, explicit_triton, layer_norm_asked_torch, torch_ffn = got["saved"]
    assert got["backend"] == "auto"
    assert got["asked"] == [90]
    assert auto_triton == explicit_triton == layer_norm_asked_torch
    assert torch_ffn > explicit_triton
