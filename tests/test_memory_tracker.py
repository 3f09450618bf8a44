"""MemoryTracker (fastbert.simulated.memory_tracker): exact on a step counted by hand, equal to the c10 CPU
allocator's own count on a BERT training step, and inside fastbert's custom ops."""
import gc

import pytest
import torch
from torch import nn

from fastbert import BertConfig
from fastbert.simulated.memory_tracker import MemoryTracker
from fastbert.bench.timing import cpu_peak_extra_bytes
from fastbert.modeling import BertForPreTraining

FP32 = 4


class _OneMatmul(nn.Module):
    """sigmoid(x @ w), or sigmoid(x @ w) * (x @ w) with keep_product: the multiply saves the product too."""

    def __init__(self, inputs: int, outputs: int, keep_product: bool):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        self.activation = nn.Sigmoid()  # saves its output for the backward
        self.keep_product = keep_product

    def forward(self, x):
        product = self.linear(x)  # mm saves x (an input) and w (a weight): no activation
        out = self.activation(product)
        return out * product if self.keep_product else out


@pytest.mark.parametrize("keep_product", [False, True])
def test_a_step_counted_by_hand(keep_product):
    rows, inputs, outputs = 64, 16, 32
    model = _OneMatmul(inputs, outputs, keep_product)
    x = torch.randn(rows, inputs)
    with MemoryTracker([model], inputs=[x]) as tracker:
        out = model(x)
        loss = out.sum()
        tracker.mark("forward end")
        loss.backward()
        tracker.mark("backward end")
    weight, batch, activation, scalar = inputs * outputs * FP32, rows * inputs * FP32, rows * outputs * FP32, FP32
    assert tracker.start_bytes == weight + batch
    forward_end = tracker.snapshot("forward end")
    if keep_product:
        # live: the sigmoid's output and the product (both saved by the multiply; the sigmoid saves its output
        # too: counted once), the result and the loss
        assert forward_end.categories["activations"] == 2 * activation
        assert forward_end.saved_by_module == {"activation": activation, "": activation}
        assert forward_end.total_bytes == weight + batch + 3 * activation + scalar
        # the backward's peak: the multiply's two input gradients, beside everything the forward left
        # (its saved tensors are released only after the node ran), the result, the loss and its seed gradient
        assert tracker.peak_bytes == weight + batch + 5 * activation + 2 * scalar
    else:
        assert forward_end.categories["activations"] == activation
        assert forward_end.saved_by_module == {"activation": activation}
        assert forward_end.total_bytes == weight + batch + activation + scalar
        # the backward's peak: when w's gradient is made, the sigmoid's input gradient, its output (still
        # held by `out`), the loss and its seed are live
        assert tracker.peak_bytes == weight + batch + weight + 2 * activation + 2 * scalar
        assert tracker.peak_snapshot().categories == {
            "weights": weight, "inputs": batch, "gradients": weight, "optimizer": 0, "weight copies": 0,
            "activations": 0, "transients": 2 * activation + 2 * scalar}
    assert tracker.phase_at_peak(["forward end", "backward end"]) == "backward end"
    assert tracker.snapshot("backward end").categories["gradients"] == weight


def test_peak_equals_the_cpu_allocators_count(one_thread):
    """A training step of a small BERT on the reference path, real CPU tensors: the tracker's peak above
    the start and the c10 allocator's (the cpu-memory suite's meter) agree within 2%."""
    torch.manual_seed(0)
    config = BertConfig.tiny(backend="torch", num_hidden_layers=1)
    model = BertForPreTraining(config)
    rows, seqlen = 4, 64
    batch = {"input_ids": torch.randint(5, config.vocab_size, (rows, seqlen)),
             "attention_mask": torch.ones(rows, seqlen, dtype=torch.long),
             "labels": torch.where(torch.rand(rows, seqlen) < 0.15, torch.randint(5, config.vocab_size, (rows, seqlen)),
                                   -100),
             "next_sentence_label": torch.zeros(rows, dtype=torch.long)}
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, in both counts
    allocator = cpu_peak_extra_bytes(step)
    with MemoryTracker([model], optimizer, inputs=batch.values()) as tracker:
        step()
    tracked = tracker.peak_bytes - tracker.start_bytes
    assert tracked == pytest.approx(allocator, rel=0.02)


def test_the_allocations_inside_a_custom_op_are_counted():
    """fastbert's ops are custom ops, one op to a dispatch mode: the attention backward's row statistics
    (delta, [B, heads, S] fp32) are allocated inside it and live beside dq, dk, dv until it returns."""
    batch, heads, seqlen, head_dim = 2, 2, 16, 32
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim) for _ in range(3))
    scale = head_dim ** -0.5
    out, lse = torch.ops.fastbert.attention_fwd(q, k, v, None, None, seqlen, None, 0.0, scale)
    dout = torch.randn_like(out)
    with MemoryTracker() as tracker:
        grads = torch.ops.fastbert.attention_bwd(dout, q, k, v, out, lse, None, None, seqlen, None, 0.0, scale)
        gc.collect()  # the interpreter's frames hold delta in a reference cycle
    delta = batch * heads * seqlen * FP32
    assert tracker.peak_bytes == 3 * q.nbytes + delta
    assert tracker.current_bytes == sum(g.nbytes for g in grads)


def test_marks_are_checked():
    with MemoryTracker() as tracker:
        tracker.mark("forward end")
        with pytest.raises(ValueError, match="'forward end' was already set"):
            tracker.mark("forward end")
    with pytest.raises(KeyError, match="no mark 'backward end'; marks: \\['forward end'\\]"):
        tracker.snapshot("backward end")
    with pytest.raises(RuntimeError, match="counts one run"):
        with tracker:
            pass


def test_a_weight_cast_is_a_weight_copy_not_an_activation():
    """Under autocast a Linear saves 16-bit copies of its input (an activation) and of its weight (made from
    the weight alone: a weight copy, which no activation count should hold)."""
    rows, inputs, outputs = 64, 16, 32
    linear = nn.Linear(inputs, outputs, bias=False)
    x = torch.randn(rows, inputs, requires_grad=True)  # else the weight is not needed by the backward
    with MemoryTracker([linear], inputs=[x]) as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = linear(x)
        tracker.mark("forward end")
    categories = tracker.snapshot("forward end").categories
    assert categories["weight copies"] == inputs * outputs * 2
    assert categories["activations"] == rows * inputs * 2
    assert categories["transients"] == out.nbytes
