"""torch.compile(fullgraph=True) and torch.export of BertModel (padded, unpad=True, packed inputs) and of
the MLM heads with labels, with their default outputs; the static MLM loss (max_predictions_per_seq)
equals the exact one and its graph reads nothing back to the host."""
import copy
import re

import pytest
import torch

import fastbert

LENGTHS = (9, 5, 2)
HOST_READS = re.compile(r"aten\.(nonzero|item|_local_scalar_dense)\.")  # ops the host must read the result of


def config(**overrides):
    values = dict(backend="torch", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=97,
                  max_position_embeddings=16)
    return fastbert.BertConfig.tiny(**{**values, **overrides})


def padded_batch(lengths=LENGTHS, labelled_per_row=2):
    generator = torch.Generator().manual_seed(sum(lengths))
    seqlen = max(lengths)
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 97, (len(lengths), seqlen), generator=generator) * mask
    labels = torch.full_like(ids, -100)
    for row, length in enumerate(lengths):
        positions = torch.randperm(length, generator=generator)[:labelled_per_row]
        labels[row, positions] = ids[row, positions]
    return dict(input_ids=ids, attention_mask=mask), labels


def packed_batch():
    inputs, _ = padded_batch()
    real = inputs["attention_mask"].bool()
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(input_ids=inputs["input_ids"][real][None], cu_seqlens=cu_seqlens, max_seqlen=max(LENGTHS)), real


def host_reads(exported):
    return [str(node.target) for node in exported.graph.nodes if HOST_READS.match(str(node.target))]


@pytest.mark.parametrize("layout", ["padded", "unpad", "packed"])
def test_bert_model_compiles_fullgraph_and_exports(layout):
    torch.manual_seed(0)
    model = fastbert.BertModel(config(unpad=layout == "unpad")).eval()
    inputs = packed_batch()[0] if layout == "packed" else padded_batch()[0]
    expected = model(**inputs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs)
    exported = torch.export.export(model, (), inputs).module()(**inputs)
    for got in (compiled, exported):
        assert type(got) is type(expected) and got.keys() == expected.keys()
        torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)


def test_exported_unpad_model_takes_other_padding():
    """unpad=True takes its sizes from the shapes: an export of one batch runs another padding."""
    torch.manual_seed(0)
    model = fastbert.BertModel(config(unpad=True)).eval()
    exported = torch.export.export(model, (), padded_batch()[0]).module()
    other, _ = padded_batch((9, 9, 1))
    torch.testing.assert_close(exported(**other).last_hidden_state, model(**other).last_hidden_state,
                               atol=1e-5, rtol=1e-5)


def test_packed_inputs_equal_padded_ones():
    torch.manual_seed(0)
    model = fastbert.BertForPreTraining(config()).eval()
    inputs, _ = padded_batch()
    packed, real = packed_batch()
    padded_out, packed_out = model(**inputs), model(**packed)
    torch.testing.assert_close(packed_out.prediction_logits[0], padded_out.prediction_logits[real])
    torch.testing.assert_close(packed_out.seq_relationship_logits, padded_out.seq_relationship_logits)
    hf = {"cu_seq_lens_q": packed["cu_seqlens"], "cu_seq_lens_k": packed["cu_seqlens"], "max_length_q": 9,
          "max_length_k": 9}  # transformers' DataCollatorWithFlattening names
    torch.testing.assert_close(model(input_ids=packed["input_ids"], **hf).prediction_logits, packed_out.prediction_logits)
    with pytest.raises(ValueError, match="max_seqlen"):
        model(**{**packed, "max_seqlen": 4})
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(**{**packed, "cu_seqlens": packed["cu_seqlens"].flip(0)})
    with pytest.raises(ValueError, match="output_attentions needs padded inputs"):
        model(**packed, output_attentions=True)  # never silently None


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForPreTraining"])
@pytest.mark.parametrize("budget", [0, 3])
def test_mlm_heads_with_labels_compile_and_export(name, budget):
    torch.manual_seed(0)
    model = getattr(fastbert, name)(config(max_predictions_per_seq=budget)).train()
    inputs, labels = padded_batch()
    expected = model(**inputs, labels=labels)
    expected.loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs, labels=labels)
    got.loss.backward()
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-6, rtol=1e-5)
    for n, p in model.named_parameters():  # unused weights (no NSP label): no gradient, or zeros when compiled
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(grad, grads[n], atol=1e-6, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    exported = torch.export.export(model, (), {**inputs, "labels": labels})
    assert host_reads(exported) == []  # budget 0 reads every position, the labelled ones first: static too
    torch.testing.assert_close(exported.module()(**inputs, labels=labels).loss, expected.loss, atol=1e-6, rtol=1e-5)


def test_static_label_budget_equals_the_exact_loss():
    torch.manual_seed(0)
    exact = fastbert.BertForPreTraining(config()).train()
    static = fastbert.BertForPreTraining(config(max_predictions_per_seq=2)).train()
    static.load_state_dict(exact.state_dict())
    inputs, labels = padded_batch(labelled_per_row=2)
    nsp = torch.tensor([0, 1, 1])
    mask_token = int(inputs["input_ids"][labels != -100][0])  # some labelled inputs show this token
    a, b = (model(**inputs, labels=labels, next_sentence_label=nsp, mask_token_id=mask_token) for model in (exact, static))
    assert a.mlm_mask_accuracy is not None
    for key in ("loss", "mlm_loss", "mlm_accuracy", "mlm_mask_accuracy"):
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-6)
    labels[0, :4] = inputs["input_ids"][0, :4]  # 4 labels in a row: more than the budget of 2
    with pytest.raises(ValueError, match="max_predictions_per_seq"):
        static(**inputs, labels=labels)
    unlabelled = torch.full_like(labels, -100)  # no label at all: loss and accuracy 0, never NaN
    out = static(**inputs, labels=unlabelled)
    assert out.mlm_loss.item() == 0 and out.mlm_accuracy.item() == 0


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForPreTraining"])
def test_applied_transformers_mlm_heads_with_labels_compile_fullgraph(name):
    """After fastbert.apply, transformers' MLM heads in training mode with labels (fastbert's fused masked-only
    loss) compile fullgraph: their forward changes no module and imports nothing while no module of the head was
    replaced since apply. Loss and gradients equal the eager applied model's and transformers' own."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    theirs = getattr(transformers, name)(hf_config).train()
    applied = fastbert.apply(copy.deepcopy(theirs))
    inputs, labels = padded_batch()
    inputs["labels"] = labels
    if name == "BertForPreTraining":
        inputs["next_sentence_label"] = torch.tensor([0, 1, 1])
    expected = {"transformers'": theirs(**inputs).loss, "eager applied": applied(**inputs).loss}
    for loss in expected.values():
        loss.backward()
    expected_grads = {"transformers'": {n: p.grad for n, p in theirs.named_parameters()},
                      "eager applied": {n: p.grad.clone() for n, p in applied.named_parameters()}}
    applied.zero_grad()
    got = torch.compile(applied, backend="aot_eager", fullgraph=True)(**inputs).loss
    got.backward()
    for reference, loss in expected.items():
        torch.testing.assert_close(got, loss, atol=1e-5, rtol=1e-4, msg=lambda m: f"{reference} loss: {m}")
        for n, p in applied.named_parameters():
            torch.testing.assert_close(p.grad, expected_grads[reference][n], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{reference} {n}: {m}")


def hf_bert(name):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return getattr(transformers, name)(hf_config)


@pytest.mark.parametrize("which", ["fastbert", "applied"])
def test_an_exported_mlm_loss_runs_at_other_batch_shapes(which):
    """The reference loss's chunk loop over the rows fixed their number in the graph: the exported program failed
    at any other batch shape (a guard on batch x length), and torch.compile recompiled for each."""
    model = (fastbert.BertForMaskedLM(config()) if which == "fastbert"
             else fastbert.apply(hf_bert("BertForMaskedLM"))).train()
    inputs, labels = padded_batch()
    batch, length = torch.export.Dim("batch", max=64), torch.export.Dim("length", max=16)
    dims = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length},
            "labels": {0: batch, 1: length}}
    exported = torch.export.export(model, (), {**inputs, "labels": labels}, dynamic_shapes=dims).module()
    other, other_labels = padded_batch(lengths=(7, 3), labelled_per_row=3)
    torch.testing.assert_close(exported(**other, labels=other_labels).loss, model(**other, labels=other_labels).loss,
                               atol=1e-6, rtol=1e-5)


def test_applied_heads_compile_fullgraph_with_return_dict_false():
    """transformers' heads pop return_dict from their kwargs before calling the base model, and torch.compile
    refused inspect.Signature.bind on that dict ("mapping proxy affected by dictionary mutation")."""
    theirs = hf_bert("BertForSequenceClassification").eval()
    applied = fastbert.apply(copy.deepcopy(theirs))
    inputs, _ = padded_batch()
    got = torch.compile(applied, backend="aot_eager", fullgraph=True)(**inputs, return_dict=False)
    assert isinstance(got, tuple) and len(got) == 1
    torch.testing.assert_close(got[0], theirs(**inputs).logits, atol=1e-5, rtol=1e-4)
    with pytest.raises(TypeError, match="got multiple values for argument 'input_ids'"):
        applied.bert(inputs["input_ids"], input_ids=inputs["input_ids"])


def test_an_unknown_keyword_compiles_fullgraph():
    """An argument transformers' BERT ignores is ignored with a warning in eager mode; the warning (a logger call)
    made a fullgraph compile fail, where transformers' model compiles."""
    model = fastbert.BertModel(config()).eval()
    inputs, _ = padded_batch()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs, an_argument_no_test_passed_before=None)
    torch.testing.assert_close(got.last_hidden_state, model(**inputs).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_prefix_keys_compile_fullgraph_and_export():
    """Prefix keys (fastbert.prefix, PEFT's prefix tuning): a transformers DynamicCache compiles without a graph
    break, and (key, value) pairs export."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = fastbert.BertModel(config()).eval()
    inputs, _ = padded_batch()
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    pairs = tuple(tuple(torch.randn(len(LENGTHS), heads, 2, head_dim) for _ in range(2))
                  for _ in range(model.config.num_hidden_layers))
    inputs["attention_mask"] = torch.cat([torch.ones(len(LENGTHS), 2, dtype=torch.long), inputs["attention_mask"]], 1)
    expected = model(**inputs, cache=pairs).last_hidden_state
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs,
                                                                          cache=transformers.DynamicCache(pairs))
    exported = torch.export.export(model, (), dict(inputs, cache=pairs)).module()(**inputs, cache=pairs)
    for got in (compiled, exported):
        torch.testing.assert_close(got.last_hidden_state, expected, atol=1e-5, rtol=1e-5)
    assert (expected - model(**padded_batch()[0]).last_hidden_state).abs().max() > 1e-2  # the prefix is read
