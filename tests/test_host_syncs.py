"""No host syncs. The counter (fastbert.host_syncs) catches each call that makes a GPU's host wait, and counts
zero in the default forward of every model (input checks on), padded, unpad=True and packed, in the family, in
ModernBERT and in transformers' models after fastbert.apply; the training steps are counted in
tests/test_pretrain.py and tests/test_finetune.py. The static sizes that take the syncs' place give the same
results: the default MLM loss equals the loss of the labelled positions alone, and unpad=True the padded
model."""
import threading

import pytest
import torch

import fastbert
from fastbert import ops
from fastbert.host_syncs import HostSyncCounter

PLANTED = [
    ("item", lambda x: x.sum().item()),
    ("tolist", lambda x: x.tolist()),
    ("nonzero", lambda x: x.nonzero()),
    ("cpu", lambda x: x.cpu()),
    ("bool", lambda x: bool(x.sum() > 0)),
    ("int", lambda x: int(x[0, 0])),
    ("float", lambda x: float(x.sum())),
    ("numpy", lambda x: x.numpy()),
    ("to(device)", lambda x: x.to("cpu")),
    ("boolean-mask indexing", lambda x: x[x > 0]),
    ("masked_select", lambda x: x.masked_select(x > 0)),
    ("unique", lambda x: x.unique()),
    ("repeat_interleave without output_size", lambda x: x.repeat_interleave(torch.tensor([1, 2, 0, 1]), dim=0)),
    ("equal", lambda x: torch.equal(x, x)),
    ("tensor(device=)", lambda x: torch.tensor([1.0, 2.0], device=x.device)),
]


@pytest.mark.parametrize("name, plant", PLANTED, ids=[p[0] for p in PLANTED])
def test_the_counter_catches_a_planted_sync(name, plant):
    x = torch.randn(4, 3)
    with HostSyncCounter() as counter:
        y = torch.nn.functional.gelu(x @ x.T)[:, :3]  # device work: no sync
        plant(y)
    assert counter.syncs == 1 and counter.calls == {name: 1}, counter.calls


NO_SYNC = [
    ("device assert", lambda x: torch._assert_async(x.sum() == x.sum(), "checked on the device")),
    ("nonzero_static", lambda x: torch.nonzero_static(x > 0, size=5)),
    ("dtype cast", lambda x: x.to(torch.float64)),
    ("non-blocking copy", lambda x: x.to("cpu", non_blocking=True)),
    ("repeat_interleave with output_size",
     lambda x: x.repeat_interleave(torch.tensor([1, 2, 0, 1]), dim=0, output_size=4)),
    ("another thread's sync", lambda x: [t.start() or t.join() for t in [threading.Thread(target=x.sum().item)]]),
]


@pytest.mark.parametrize("name, call", NO_SYNC, ids=[c[0] for c in NO_SYNC])
def test_the_counter_ignores_what_does_not_sync(name, call):
    x = torch.randn(4, 3)
    with HostSyncCounter() as counter:
        call(x)
    assert counter.syncs == 0, counter.calls


B, S = 3, 8


def padded_batch(vocab_size=99, type_vocab_size=2, pad_token_id=0):
    generator = torch.Generator().manual_seed(0)
    mask = (torch.arange(S)[None, :] < torch.tensor([8, 5, 1])[:, None]).long()
    ids = torch.randint(pad_token_id + 1, vocab_size, (B, S), generator=generator).masked_fill(mask == 0, pad_token_id)
    labels = torch.where((torch.rand(B, S, generator=generator) < 0.4) & mask.bool(), ids, -100)
    labels[:, 0] = ids[:, 0]
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if type_vocab_size > 1:
        batch["token_type_ids"] = (torch.arange(S)[None, :] >= 3).long().expand(B, S) * mask
    return batch


def packed_batch():
    batch = padded_batch()
    real = batch["attention_mask"].bool()
    cu_seqlens = torch.nn.functional.pad(real.sum(1).cumsum(0), (1, 0)).int()
    return dict(input_ids=batch["input_ids"][real][None], token_type_ids=batch["token_type_ids"][real][None],
                cu_seqlens=cu_seqlens, max_seqlen=S)


def without(batch, *names):
    return {k: v for k, v in batch.items() if k not in names}


def transformers_bert(head):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, max_position_embeddings=16)
    return fastbert.apply(getattr(transformers, head)(config))


TINY = dict(vocab_size=99, max_position_embeddings=16)
CASES = {  # name: (model, inputs, train: a backward too)
    "BertModel padded": lambda: (fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)),
                                 without(padded_batch(), "labels"), False),
    "BertModel unpad=True": lambda: (fastbert.BertModel(fastbert.BertConfig.tiny(**TINY, unpad=True)),
                                     without(padded_batch(), "labels"), False),
    "BertModel packed": lambda: (fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)), packed_batch(), False),
    "BertModel packed without max_seqlen": lambda: (fastbert.BertModel(fastbert.BertConfig.tiny(**TINY)),
                                                    without(packed_batch(), "max_seqlen"), False),
    "BertForPreTraining unpad=True, labels": lambda: (
        fastbert.BertForPreTraining(fastbert.BertConfig.tiny(**TINY, unpad=True)),
        {**padded_batch(), "next_sentence_label": torch.tensor([0, 1, 1])}, True),
    "BertForQuestionAnswering, positions": lambda: (
        fastbert.BertForQuestionAnswering(fastbert.BertConfig.tiny(**TINY, num_labels=2)),
        {**without(padded_batch(), "labels"), "start_positions": torch.tensor([1, 2, 0]),
         "end_positions": torch.tensor([3, 4, 0])}, True),
    "RobertaForMaskedLM, labels": lambda: (fastbert.RobertaForMaskedLM(fastbert.RobertaConfig.tiny(**TINY)),
                                           padded_batch(type_vocab_size=1, pad_token_id=1), True),
    "ModernBertForMaskedLM, labels": lambda: (fastbert.ModernBertForMaskedLM(fastbert.ModernBertConfig.tiny()),
                                              padded_batch(type_vocab_size=1), True),
    "transformers BertModel, applied": lambda: (transformers_bert("BertModel"), without(padded_batch(), "labels"),
                                                False),
    "transformers BertForMaskedLM, applied, labels": lambda: (transformers_bert("BertForMaskedLM"), padded_batch(),
                                                              True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_default_forward_never_syncs_with_the_host(case):
    torch.manual_seed(0)
    model, inputs, train = CASES[case]()
    model.train(train)
    with HostSyncCounter() as counter:
        output = model(**inputs)  # validate=True, the default
        if train:
            output.loss.backward()
    assert counter.syncs == 0, counter.calls


def test_the_value_checks_still_fail_at_once_on_cpu():
    model = fastbert.BertForPreTraining(fastbert.BertConfig.tiny(**TINY, max_predictions_per_seq=2))
    batch = padded_batch()
    with pytest.raises(ValueError, match="input_ids contains 99, which is >= vocab_size"):
        model(**{**batch, "input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == batch["input_ids"][0, 1],
                                                                      99)})
    with pytest.raises(ValueError, match="labels has a sequence with 4 labelled tokens, more than "
                                         "max_predictions_per_seq \\(2\\)"):
        model(**{**batch, "labels": batch["input_ids"].masked_fill(torch.arange(S) >= 4, -100)})


def test_the_default_mlm_loss_equals_the_labelled_positions_alone():
    """max_predictions_per_seq = 0 reads every position, the labelled ones first (no host sync): the loss, the
    accuracy and the gradients of reading exactly the labelled rows (a boolean mask here)."""
    torch.manual_seed(0)
    model = fastbert.BertForMaskedLM(fastbert.BertConfig.tiny(**TINY, hidden_dropout_prob=0.0,
                                                                attention_probs_dropout_prob=0.0)).train()
    batch = padded_batch()
    labels = batch.pop("labels")
    out = model(**batch, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    labelled = labels != -100
    head = model.vocabulary_head()
    rows = head.transform(model.bert(**batch).last_hidden_state[labelled])  # [N, H]
    loss, correct = ops.linear_cross_entropy(rows, head.decoder.weight, head.bias, labels[labelled])
    loss.backward()
    assert torch.equal(out.loss, loss)
    assert torch.equal(out.accuracy, correct / labelled.sum())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-7, rtol=1e-6, msg=lambda m: f"{name}: {m}")


def test_unpad_rows_of_padding_reach_no_result_and_no_gradient():
    """unpad=True runs B*S rows, the padding among them: the real positions' outputs and every gradient are the
    padded model's."""
    torch.manual_seed(0)
    config = fastbert.BertConfig.tiny(**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    padded = fastbert.BertForTokenClassification(config).train()
    unpadded = fastbert.BertForTokenClassification(config.replace(unpad=True)).train()
    unpadded.load_state_dict(padded.state_dict())
    batch = padded_batch()
    batch["labels"] = batch["labels"].clamp(max=1)
    real = batch["attention_mask"].bool()
    a, b = padded(**batch), unpadded(**batch)
    torch.testing.assert_close(b.logits[real], a.logits[real], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(b.logits).all()
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(padded.named_parameters(), unpadded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_on_a_gpu_a_default_forward_and_step_never_sync(case):
    """What the counter counts on CPU, CUDA's sync debug mode checks on a GPU: after two warm-up steps (Triton's
    autotuning synchronizes), a forward (and for training cases its backward and a fused AdamW step) raises on
    any synchronizing CUDA call."""
    torch.manual_seed(0)
    model, inputs, train = CASES[case]()
    model = model.cuda().train(train)
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None

    def step():
        output = model(**inputs)
        if train:
            output.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
