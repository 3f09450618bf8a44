"""The memory plan (fastbert.bench.memory_plan, meta_gpu): the autocast emulation against the real autocast,
a plan through the real launchers against the bytes each op saves, and the plan's argument checks."""
import json
import os
import subprocess
import sys

import pytest
import torch

from fastbert import BertConfig
from fastbert.bench.memory_plan import plan_step
from fastbert.bench.memory_tracker import MemoryTracker
from fastbert.bench.meta_gpu import CPU_AUTOCAST, AutocastEmulation
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


def test_the_triton_path_is_not_planned_in_the_interpreter():
    """Under TRITON_INTERPRET=1 (this process) the kernels are interpreted ones, which read data: a plan of
    the Triton path says so instead of failing inside Triton."""
    config = BertConfig.tiny(backend="triton", max_predictions_per_seq=3)
    with torch.device("meta"):
        model = BertForPreTraining(config)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 made the kernels interpreted ones"):
        plan_step(model, _pretraining_batch(config, 2, 16, device="meta"))
