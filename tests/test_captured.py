"""CUDA graphs for inference: fastbert.CapturedForward pads a batch up to its (batch size, length bucket) and
returns what the eager forward returns for the real rows and positions, eagerly on CPU (tested here) and
replaying one captured graph per shape on a GPU (the tests marked gpu); torch.compile(mode="reduce-overhead")
captures a fastbert forward too."""
import pytest
import torch
from torch.utils import _pytree as pytree

import fastbert
from fastbert.captured import WARMUP_RUNS, CapturedForward, length_buckets

TINY = dict(vocab_size=99, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def batch(rows=3, length=7, device="cpu", pad_token_id=0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(pad_token_id + 1, 99, (rows, length), generator=generator).masked_fill(mask == 0, pad_token_id)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def seen_shapes(model):
    """The input_ids shapes model.forward runs on, appended as it runs (not its runs on meta tensors, which read
    the outputs' shapes)."""
    shapes = []

    def record(module, args, kwargs):
        if not kwargs["input_ids"].is_meta:
            shapes.append(tuple(kwargs["input_ids"].shape))
    model.register_forward_pre_hook(record, with_kwargs=True)
    return shapes


def assert_same_outputs(got, expected, tolerance=1e-5):
    assert type(got) is type(expected) and list(got.keys()) == list(expected.keys())
    got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for a, b in zip(got_leaves, expected_leaves):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_length_buckets_are_powers_of_two_up_to_the_longest():
    assert length_buckets(128) == (16, 32, 64, 128)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(8) == (8,)


def test_a_batch_runs_at_the_smallest_shape_that_holds_it():
    model = fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)).eval()
    forward = fastbert.CapturedForward(model, batch_sizes=(8, 2, 4), length_buckets=(16, 8))
    assert forward.padded_shape(3, 7) == (4, 8)
    assert forward.padded_shape(1, 9) == (2, 16)
    assert forward.padded_shape(8, 16) == (8, 16)
    with pytest.raises(ValueError, match="batch size 9 is larger than the largest captured one \\(8\\)"):
        forward.padded_shape(9, 4)
    with pytest.raises(ValueError, match="length 17 is larger than the largest captured one \\(16\\).*length_buckets"):
        forward.padded_shape(2, 17)


def test_bad_sizes_and_a_training_model_are_refused():
    model = fastbert.BertModel(fastbert.BertConfig.tiny(**TINY))
    with pytest.raises(ValueError, match="length_buckets holds 64, more than the 32 tokens"):
        CapturedForward(model, length_buckets=(16, 64))
    with pytest.raises(ValueError, match="batch_sizes must be positive ints"):
        CapturedForward(model, batch_sizes=(0, 4), length_buckets=(16,))
    with pytest.raises(ValueError, match="eval mode"):
        CapturedForward(model.train(), length_buckets=(16,))(**batch())
    # a mask or token types of another shape than input_ids: copied into the padded buffer, they broadcast (a [1, S]
    # mask over every row) or were cut, where the plain forward refuses them
    forward, inputs = CapturedForward(model.eval(), length_buckets=(16,)), batch()
    ids = inputs["input_ids"]
    for name, bad in (("attention_mask", torch.ones(1, ids.shape[1], dtype=torch.long)),
                      ("attention_mask", torch.ones(ids.shape[0], ids.shape[1] - 2, dtype=torch.long)),
                      ("attention_mask", torch.ones(ids.shape[1], dtype=torch.long)),
                      ("token_type_ids", torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.long))):
        with pytest.raises(ValueError, match=rf"{name} has shape \({', '.join(map(str, bad.shape))},?\), expected"):
            forward(**{**inputs, name: bad})


def _bert_with_hidden_states():
    return fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)), {"output_hidden_states": True}


def _bert_with_attentions():
    return fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)), {"output_attentions": True}


def _modernbert_mlm():
    return fastbert.ModernBertForMaskedLM(fastbert.ModernBertConfig.tiny(vocab_size=99)), {}


def _transformers_question_answering():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, max_position_embeddings=32)
    return fastbert.apply(transformers.BertForQuestionAnswering(config)), {}


MODELS = {"BertModel, hidden states": _bert_with_hidden_states, "BertModel, attentions": _bert_with_attentions,
          "ModernBertForMaskedLM": _modernbert_mlm, "transformers BertForQuestionAnswering, applied":
          _transformers_question_answering}


@pytest.mark.parametrize("name", MODELS)
def test_outputs_are_the_eager_forwards_for_the_real_rows(name):
    """Per-sequence ([B, H]), per-token ([B, S, ...], [B, S]) and per-pair ([B, heads, S, S]) outputs, cut back
    from the padded shape (4, 8) to the batch's (3, 7)."""
    torch.manual_seed(0)
    model, options = MODELS[name]()
    model.eval()
    forward = CapturedForward(model, batch_sizes=(2, 4), length_buckets=(8, 16), **options)
    inputs = batch(pad_token_id=model.config.pad_token_id or 0)
    expected = model(**inputs, **options)
    shapes = seen_shapes(model)
    assert_same_outputs(forward(**inputs), expected)
    assert shapes == [(4, 8)]


@pytest.mark.gpu
def test_one_graph_per_shape_is_captured_then_replayed():
    torch.manual_seed(0)
    model = fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)).cuda().eval()
    forward = CapturedForward(model, batch_sizes=(4,), length_buckets=(8, 16), output_hidden_states=True)
    calls = [batch(rows, length, "cuda", seed=seed) for seed, (rows, length) in enumerate([(3, 7), (4, 8), (2, 5),
                                                                                          (3, 12)])]
    with torch.no_grad():
        expected = [model(**inputs, output_hidden_states=True) for inputs in calls]
    shapes = seen_shapes(model)
    for inputs, want in zip(calls, expected):  # the same static inputs hold each call's data in turn
        assert_same_outputs(forward(**inputs), want, tolerance=1e-4)
    # warm-up runs and the capture at (4, 8), then at (4, 16); the other two calls replay the first graph
    assert shapes == [(4, 8)] * (WARMUP_RUNS + 1) + [(4, 16)] * (WARMUP_RUNS + 1)
    assert len(forward.graphs) == 2


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_captures_the_forward():
    torch.manual_seed(0)
    model = fastbert.BertModel(fastbert.BertConfig.tiny(**TINY, unpad=True)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    from torch._dynamo.utils import counters
    counters.clear()
    inputs = batch(4, 16, "cuda")
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        for _ in range(3):  # warm-up, recording, replay
            got = compiled(**inputs).last_hidden_state.clone()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
