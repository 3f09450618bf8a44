"""The family's base models accelerated by `fastbert.apply(model, backend="triton")`, on the Triton kernels
(the interpreter on CPU): every hidden state, the pooled output and every parameter's gradient within
DESIGN.md's tolerance rule against transformers run in float64, in fp32, fp16 and bf16, padded and
unpad=True; and packed inputs (cu_seqlens, as DataCollatorWithFlattening gives them) equal the padded batch
on real tokens, with RoBERTa-type and MPNet positions restarting at pad_token_id + 1 in each sequence."""
import copy

import pytest
import torch
from family_models import (ARCHITECTURES, LENGTHS, TRITON_SIZES, base_loss, flattened, hf_model, padded_batch,
                           to_device)
from tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, assert_within_rule, pytorch_in

import fastbert

transformers = pytest.importorskip("transformers")


def run(model, inputs, mask):
    """The model's outputs with every hidden state, and the gradients of base_loss (all parameters)."""
    output = model(**inputs, output_hidden_states=True)
    base_loss(output, mask).backward()
    return output, {name: param.grad for name, param in model.named_parameters()}


def assert_triton_within_the_rule(exact, inputs, dtype, unpad, noise_only=()):
    """`exact` (transformers' model in float64) in `dtype`, plain and accelerated on the kernels: every hidden
    state, the pooled output and every parameter's gradient of the accelerated one within the rule. Gradients
    named by a suffix in `noise_only` are 0 in exact arithmetic, their values in `dtype` rounding noise: those
    are held to the dtype's epsilon times the largest gradient of the same Linear's weight instead."""
    in_dtype = copy.deepcopy(exact).to(dtype)
    kernels = fastbert.apply(copy.deepcopy(in_dtype), backend="triton", unpad=unpad)
    fast = vars(kernels)[fastbert.in_place.ACCELERATED]
    assert fast.config.backend == "triton" and fast.config.unpad is unpad
    mask = inputs["attention_mask"]
    real = mask.bool()
    with pytorch_in(dtype):  # both: the two models differ by the kernels alone
        out, grads = run(kernels, inputs, mask)
        torch_out, torch_grads = run(in_dtype, inputs, mask)
    exact_out, exact_grads = run(exact, inputs, mask)
    assert len(out.hidden_states) == exact.config.num_hidden_layers + 1
    for layer, states in enumerate(zip(out.hidden_states, torch_out.hidden_states, exact_out.hidden_states)):
        assert_within_rule(f"hidden state {layer}", *(state[real] for state in states), FORWARD_FACTOR)
    if exact_out.get("pooler_output") is not None:
        assert_within_rule("pooler_output", out.pooler_output, torch_out.pooler_output, exact_out.pooler_output,
                           FORWARD_FACTOR)
    for name, grad in exact_grads.items():
        assert grad is not None and grads[name] is not None, name
        if name.endswith(noise_only):
            assert grad.abs().max() < 1e-12, f"d {name} is not 0 in float64"
            scale = exact_grads[name.removesuffix("bias") + "weight"].abs().max().item()
            assert grads[name].abs().max().item() <= torch.finfo(dtype).eps * scale, name
        else:
            assert_within_rule(f"d {name}", grads[name], torch_grads[name], grad, GRADIENT_FACTOR)


# XLM-RoBERTa and CamemBERT are RoBERTa's modules under other config classes: the model paths are RoBERTa's,
# DistilBERT's, ELECTRA's and MPNet's, each in fp32 padded and in bf16 unpadded in the first test command
MODEL_PATHS = ("roberta", "distilbert", "electra", "mpnet")
CROSS_PRODUCT = pytest.mark.slow(reason="the rest of architecture x dtype x layout: each model path, kernel and "
                                        "layout is in fp32 padded and bf16 unpadded without it")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RULE_CASES = [pytest.param(arch, dtype, unpad, id=f"{arch}-{name}-{'unpadded' if unpad else 'padded'}",
                           marks=() if arch in MODEL_PATHS and (name, unpad) in (("fp32", False), ("bf16", True))
                           else CROSS_PRODUCT)
              for arch in ARCHITECTURES for name, dtype in DTYPES.items() for unpad in (False, True)]


# The key projections' biases, by the family's names (BERT's, DistilBERT's, MPNet's). Their gradient is 0 in exact
# arithmetic: softmax ignores a shift of every score of a query, and q . b_k is one such shift.
KEY_BIASES = (".key.bias", ".k_lin.bias", ".k.bias")


@pytest.mark.parametrize("arch, dtype, unpad", RULE_CASES)
def test_triton_path_within_the_rule_against_float64(arch, dtype, unpad, device):
    """In fp16 and bf16 the key biases' gradients are rounding noise on both sides, the kernel's and PyTorch's
    (whose yardstick rounds each op once, so its noise is smaller than a real bf16 run's): they are held to the
    noise bound. fp32 keeps the rule for them too."""
    exact = hf_model(arch, **TRITON_SIZES).double().to(device)
    noise_only = KEY_BIASES if dtype != torch.float32 else ()
    assert_triton_within_the_rule(exact, to_device(padded_batch(exact.config), device), dtype, unpad, noise_only)


@pytest.mark.slow(reason="S = 200 on the kernels; the last bucket (distances of 128 and more) is "
                         "test_attention_relative_bias's at S = 129 in fp32 and bf16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mpnet_bias_past_128_tokens_within_the_rule(dtype, device):
    """Distances past MPNet's 128 (the last bucket), with a table of 64 buckets of which transformers reads 32;
    unpad=True: the bias in the varlen kernel. The key biases' gradient is 0 (softmax ignores a shift of every
    score of a query); in bf16, summed over 331 tokens of rounded key gradients, its noise is the kernel's 4x
    PyTorch's, both under bf16's epsilon times the key weights' gradient (fp32 keeps the rule)."""
    exact = hf_model("mpnet", relative_attention_num_buckets=64, max_position_embeddings=260, **TRITON_SIZES)
    exact = exact.double().to(device)
    inputs = to_device(padded_batch(exact.config, lengths=(200, 130, 1), seq=200), device)
    bf16 = dtype == torch.bfloat16
    assert_triton_within_the_rule(exact, inputs, dtype, unpad=bf16, noise_only=KEY_BIASES if bf16 else ())


@pytest.mark.parametrize("arch", [arch if arch in MODEL_PATHS else pytest.param(arch, marks=pytest.mark.slow(
    reason="RoBERTa's model path and positions under another config class")) for arch in ARCHITECTURES])
def test_packed_inputs_equal_the_padded_batch(arch, device):
    model = fastbert.apply(hf_model(arch, **TRITON_SIZES).to(device), backend="triton")
    config = model.config
    inputs = to_device(padded_batch(config), device)
    mask = inputs["attention_mask"]
    padded = model(**inputs)
    base_loss(padded, mask).backward()
    expected_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    # transformers' RoBERTa and MPNet count positions from pad_token_id + 1 (RobertaEmbeddings)
    start = config.pad_token_id + 1 if arch in ("roberta", "xlm-roberta", "camembert", "mpnet") else 0
    packed = to_device(flattened(inputs, start), device)
    assert packed["cu_seq_lens_q"].tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    for with_positions in (True, False):  # fastbert's default positions restart at the same offset
        model.zero_grad()
        given = packed if with_positions else {k: v for k, v in packed.items() if k != "position_ids"}
        out = model(**given)
        assert out.last_hidden_state.shape == (1, sum(LENGTHS), config.hidden_size)
        torch.testing.assert_close(out.last_hidden_state[0], padded.last_hidden_state[mask.bool()], atol=1e-5,
                                   rtol=1e-5)
        if padded.get("pooler_output") is not None:
            torch.testing.assert_close(out.pooler_output, padded.pooler_output, atol=1e-5, rtol=1e-5)
        base_loss(out, torch.ones(out.last_hidden_state.shape[:2], device=device)).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"d {name}: {m}")
