"""The attention and feed-forward sublayers as one autograd node each (fastbert/sublayer.py) against the same ops
run one by one: the same loss and gradients to the bit, padded and unpadded, with dropout, under autocast, with
frozen weights and recomputed; one node a sublayer where it runs, the per-op graph where it must not (traced calls,
hooks, attention probabilities, the torch path)."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import fastbert
from fastbert import family, modeling, ops, paths
from fastbert.kernels.fused_op import always_custom_op

CONFIG = fastbert.BertConfig.tiny(vocab_size=97, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                  max_position_embeddings=32, backend="triton")  # dropout 0.1 on both
LENGTHS, SEQ = (9, 5), 9


def _inputs(device):
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(1, CONFIG.vocab_size, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    labels = torch.full_like(ids, -100)
    labels[0, 1], labels[1, 3] = ids[0, 1], ids[1, 3]
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, next_sentence_label=torch.tensor([0, 1]))
    return {k: v.to(device) for k, v in inputs.items()}


def _hook_outputs(model):
    """A no-op hook on each attention's output module: the model then calls that sublayer's ops one by one."""
    return [m.register_forward_pre_hook(lambda *args: None) for m in model.modules()
            if type(m) is modeling.BertSelfOutput]


@contextlib.contextmanager
def _per_op():
    """Every sublayer's ops one by one, as before fastbert/sublayer.py: its two entrances answer None."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling.SelfAttention, "sublayer", lambda *args, **kwargs: None)
        for module in (modeling, family):
            patch.setattr(module, "fused_feed_forward_sublayer", lambda *args: None)
        yield


def _step(device, per_op, unpad=False, autocast=False, frozen=False, **config):
    torch.manual_seed(0)
    model = fastbert.BertForPreTraining(CONFIG.replace(unpad=unpad, **config)).to(device).train()
    if frozen:  # BitFit: the biases alone train
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("bias" in name)
    return _step_on(model, device, per_op, autocast)


def _step_on(model, device, per_op, autocast=False, next_sentence=True):
    """A training step on `_inputs` (without the NSP label for a masked-LM model): (model, loss, its parameters'
    gradients)."""
    inputs = _inputs(device)
    if not next_sentence:
        del inputs["next_sentence_label"]
    torch.manual_seed(1)  # the dropout seeds
    with _per_op() if per_op else contextlib.nullcontext():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
    return model, loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _nodes(loss) -> list:
    seen, stack, nodes = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def _node_types(loss) -> list[str]:
    return [type(node).__name__ for node in _nodes(loss)]


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
@pytest.mark.parametrize("autocast, frozen", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "autocast-bf16", "bitfit"])
def test_one_node_gives_the_per_op_results_bitwise(unpad, autocast, frozen, device):
    model, loss, grads = _step(device, per_op=False, unpad=unpad, autocast=autocast, frozen=frozen)
    _, per_op_loss, per_op_grads = _step(device, per_op=True, unpad=unpad, autocast=autocast, frozen=frozen)
    nodes = _node_types(loss)
    assert nodes.count("_AttentionSublayerBackward") == nodes.count("_FeedForwardSublayerBackward") == 2
    assert "CatBackward0" not in nodes and "TransposeBackward0" not in nodes
    assert "_AttentionSublayerBackward" not in _node_types(per_op_loss)
    assert torch.equal(loss, per_op_loss)
    assert grads.keys() == per_op_grads.keys()
    if frozen:
        assert all("bias" in name for name in grads)
    for name, grad in grads.items():
        assert grad.dtype == dict(model.named_parameters())[name].dtype
        assert torch.equal(grad, per_op_grads[name]), name


@contextlib.contextmanager
def _qkv_on_torch_path():
    """The QKV projection resolves to PyTorch's path, as backend="auto" chooses on an H100 at BERT-base's training
    shape (fastbert/paths.json); every other op to its kernel."""
    resolve = ops.resolve_backend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "resolve_backend", lambda backend, *tensors, op=None, **kw:
                      "torch" if op == "qkv_projection" else resolve(backend, *tensors, op=op, **kw))
        yield


@pytest.mark.parametrize("architecture, options", [
    ("bert", dict(unpad=False)), ("bert", dict(unpad=True, autocast=True)), ("bert", dict(frozen=True)),
    ("modernbert", dict(autocast=True)), ("modernbert", dict(frozen=True, attention_bias=True))],
    ids=["bert-padded", "bert-unpadded-autocast-bf16", "bert-bitfit", "modernbert-autocast-bf16",
         "modernbert-frozen-biases"])
def test_qkv_on_the_torch_path_is_in_the_node_with_the_per_op_results(architecture, options, device):
    """Where the QKV projection resolves to PyTorch's path the attention sublayer is still one node, which runs
    that path's forward and its GEMMs over attention's gradient buffer as it is: bitwise what the ops one by one
    give, where autograd's unbind backward stacks dq, dk and dv first."""
    step = _step if architecture == "bert" else _modernbert_step
    kernel, in_place = ops.KERNELS["qkv"], []
    one_matrix = kernel._one_matrix

    def spy(*args):
        matrix = one_matrix(*args)
        in_place.append(matrix is not None)
        return matrix

    with _qkv_on_torch_path(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "_one_matrix", spy)
        model, loss, grads = step(device, per_op=False, **options)
        _, per_op_loss, per_op_grads = step(device, per_op=True, **options)
    nodes, per_op_nodes = _node_types(loss), _node_types(per_op_loss)
    layers = model.config.num_hidden_layers
    assert nodes.count("_AttentionSublayerBackward") == layers
    assert in_place == [True] * layers  # each node's backward read dQKV where attention wrote it: no gather
    assert "UnbindBackward0" in per_op_nodes and "UnbindBackward0" not in nodes  # the per-op path is PyTorch's
    assert torch.equal(loss, per_op_loss)
    assert grads.keys() == per_op_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == dict(model.named_parameters())[name].dtype
        assert torch.equal(grad, per_op_grads[name]), name


def test_the_node_resolves_the_qkv_projection_as_the_ops_one_by_one_do(device):
    """The node resolves the QKV projection's path on what the per-op call hands resolve_backend: its direction (a
    table's training or inference rows) from hidden and every QKV Linear, so that a frozen query beside a trained
    key resolves as their concatenated weight does; and where PyTorch's path refuses the dtypes (no autocast) the
    ops run one by one and raise its error, which the node's form, casting, would not."""
    resolve, chosen = ops.resolve_backend, []

    def by_direction(backend, *tensors, op=None, **kw):  # PyTorch's path in training, the kernel's in inference
        if op != "qkv_projection":
            return resolve(backend, *tensors, op=op, **kw)
        chosen.append("torch" if paths.backward_follows(tensors) else "triton")
        return chosen[-1]

    def step(per_op, frozen=(), dtype=None):
        torch.manual_seed(0)
        model = fastbert.BertForPreTraining(CONFIG).to(device).train()
        first = model.bert.encoder.layer[0].attention.self
        for name, parameter in model.named_parameters():  # layer 0's input, its query frozen: its key trains
            parameter.requires_grad_(not any(name.startswith(prefix) for prefix in frozen))
        if dtype is not None:
            for linear in (first.query, first.key, first.value):
                linear.to(dtype)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops, "resolve_backend", by_direction)
            chosen.clear()
            _step_on(model, device, per_op)
        return list(chosen)

    frozen = ("bert.embeddings", "bert.encoder.layer.0.attention.self.query")
    assert step(per_op=False, frozen=frozen) == step(per_op=True, frozen=frozen) == ["torch", "torch"]
    for per_op in (False, True):
        with pytest.raises(RuntimeError, match="dtype"):
            step(per_op, dtype=torch.bfloat16)


def test_nodes_hold_their_tensors_through_autograd_alone(device):
    """Outside a backward no op context of a node holds a tensor (they would escape the saved-tensor hooks, and the
    LayerNorm's saved output would make a reference cycle with its node), and a retained graph gives the same
    gradients to a second backward."""
    torch.manual_seed(0)
    model = fastbert.BertForPreTraining(CONFIG).to(device).train()
    loss = model(**_inputs(device)).loss
    nodes = [node for node in _nodes(loss) if type(node).__name__.endswith("SublayerBackward")]
    assert len(nodes) == 4

    def held():
        return [context for node in nodes for context in node.contexts if context.saved_tensors is not None]

    assert not held()
    parameters = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
    assert not held()
    second = torch.autograd.grad(loss, parameters, allow_unused=True)
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)


def test_distilbert_attention_is_one_node_with_the_per_op_results(device):
    """DistilBERT's sublayers (no dropout on the attention's sum, their own module names) take the nodes too."""
    def step(per_op):
        torch.manual_seed(0)
        model = fastbert.DistilBertForMaskedLM(fastbert.DistilBertConfig.tiny(
            vocab_size=97, dim=64, n_heads=2, hidden_dim=128, n_layers=2, max_position_embeddings=32,
            backend="triton")).to(device).train()
        return _step_on(model, device, per_op, next_sentence=False)

    _, loss, grads = step(per_op=False)
    _, per_op_loss, per_op_grads = step(per_op=True)
    nodes = _node_types(loss)
    assert nodes.count("_AttentionSublayerBackward") == nodes.count("_FeedForwardSublayerBackward") == 2
    assert torch.equal(loss, per_op_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, per_op_grads[name]), name


MPNET_TABLE = "mpnet.encoder.relative_attention_bias.weight"


def _mpnet_step(device, per_op, autocast=False, table_only=False, **config):
    torch.manual_seed(0)
    model = fastbert.MPNetForMaskedLM(fastbert.MPNetConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=40, backend="triton", **config)).to(device).train()  # dropout 0.1 on both
    with torch.no_grad():  # a table that moves the scores (its initialisation is small)
        model.mpnet.encoder.relative_attention_bias.weight.normal_()
    if table_only:  # no gradient but the table's: the nodes' backward runs attention's for it alone
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name == MPNET_TABLE)
    return _step_on(model, device, per_op, autocast, next_sentence=False)


@pytest.mark.parametrize("options, qkv_on_torch_path", [
    (dict(unpad=False), False), (dict(unpad=True, autocast=True), True), (dict(table_only=True), False)],
    ids=["padded", "unpadded-autocast-bf16-qkv-torch-path", "table-only"])
def test_mpnet_attention_with_its_relative_bias_is_one_node_with_the_per_op_results(options, qkv_on_torch_path,
                                                                                     device):
    """MPNet's sublayers take the nodes too: each attention node reads the relative-position bias table every layer
    shares and returns its layer's share of the table's gradient, which autograd sums as over the per-op nodes."""
    with _qkv_on_torch_path() if qkv_on_torch_path else contextlib.nullcontext():
        model, loss, grads = _mpnet_step(device, per_op=False, **options)
        _, per_op_loss, per_op_grads = _mpnet_step(device, per_op=True, **options)
    nodes = _node_types(loss)
    assert nodes.count("_AttentionSublayerBackward") == nodes.count("_FeedForwardSublayerBackward") == 2
    assert "_AttentionSublayerBackward" not in _node_types(per_op_loss)
    assert torch.equal(loss, per_op_loss)
    assert grads.keys() == per_op_grads.keys()
    assert MPNET_TABLE in grads and grads[MPNET_TABLE].abs().sum() > 0
    assert len(grads) == 1 if options.get("table_only") else len(grads) > 1
    for name, grad in grads.items():
        assert torch.equal(grad, per_op_grads[name]), name
    model.mpnet.encoder.layer[0].attention.attn.register_forward_hook(lambda *args: None)
    inputs = _inputs(device)
    del inputs["next_sentence_label"]
    assert _node_types(model(**inputs).loss).count("_AttentionSublayerBackward") == 1  # the hooked one runs its ops


def test_the_ops_run_one_by_one_where_the_node_must_not(device):
    torch.manual_seed(0)
    model = fastbert.BertForPreTraining(CONFIG).to(device).train()
    inputs = _inputs(device)

    def sublayer_nodes(**kwargs):
        nodes = _node_types(model(**inputs, **kwargs).loss)
        return nodes.count("_AttentionSublayerBackward"), nodes.count("_FeedForwardSublayerBackward")

    assert sublayer_nodes() == (2, 2)
    assert sublayer_nodes(output_attentions=True) == (0, 2)  # the probabilities come from the per-op attention
    with always_custom_op():  # as under torch.compile, torch.export and dispatch modes: the custom ops
        assert sublayer_nodes() == (0, 0)
    handles = _hook_outputs(model)
    assert sublayer_nodes() == (0, 2)
    for handle in handles:
        handle.remove()
    layer = model.bert.encoder.layer[0]
    layer.attention.self.register_forward_hook(lambda *args: None)
    layer.intermediate.register_forward_hook(lambda *args: None)
    assert sublayer_nodes() == (1, 1)  # the hooked layer alone runs its ops
    model.config.backend = "torch"
    assert sublayer_nodes() == (0, 0)


MODERNBERT = fastbert.ModernBertConfig.tiny(vocab_size=97, hidden_size=64, num_attention_heads=2, intermediate_size=96,
                                            local_attention=4, attention_dropout=0.1, backend="triton")


def _modernbert_step(device, per_op, autocast=False, frozen=False, **config):
    torch.manual_seed(0)
    model = fastbert.ModernBertForMaskedLM(MODERNBERT.replace(**config)).to(device).train()
    if frozen:  # the biases and LayerNorms alone train
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("bias" in name or "norm" in name)
    return _step_on(model, device, per_op, autocast, next_sentence=False)


@pytest.mark.parametrize("autocast, frozen, biases", [(False, False, False), (True, False, True), (False, True, True)],
                         ids=["fp32", "autocast-bf16-biases", "frozen-biases"])
def test_modernbert_pre_norm_attention_is_one_node_with_the_per_op_results(autocast, frozen, biases, device):
    """ModernBERT's pre-LN attention sublayer (attn_norm, Wqkv, rotary attention with a window on local layers and
    probability dropout, Wo, then mlp_norm returning the residual stream; the first layer without attn_norm) is one
    node a layer, bitwise the ops run one by one."""
    config = dict(norm_bias=True, attention_bias=True, mlp_bias=True) if biases else {}
    model, loss, grads = _modernbert_step(device, per_op=False, autocast=autocast, frozen=frozen, **config)
    _, per_op_loss, per_op_grads = _modernbert_step(device, per_op=True, autocast=autocast, frozen=frozen, **config)
    nodes, per_op_nodes = _node_types(loss), _node_types(per_op_loss)
    layers = MODERNBERT.num_hidden_layers
    assert nodes.count("_AttentionSublayerBackward") == layers and "_QKVProjectionBackward" not in nodes
    def matmuls(types):
        return types.count("MmBackward0") + types.count("AddmmBackward0")
    assert matmuls(nodes) == matmuls(per_op_nodes) - layers  # Wo's, in the node
    assert "_AttentionSublayerBackward" not in per_op_nodes
    assert torch.equal(loss, per_op_loss)
    assert grads.keys() == per_op_grads.keys()
    assert any("attn_norm" in name for name in grads) and any("Wqkv" in name for name in grads)
    for name, grad in grads.items():
        assert grad.dtype == dict(model.named_parameters())[name].dtype
        assert torch.equal(grad, per_op_grads[name]), name


def test_modernbert_runs_its_ops_one_by_one_where_the_node_must_not(device):
    torch.manual_seed(0)
    model = fastbert.ModernBertForMaskedLM(MODERNBERT).to(device).train()
    inputs = _inputs(device)
    del inputs["next_sentence_label"]

    def attention_nodes(**kwargs):
        return _node_types(model(**inputs, **kwargs).loss).count("_AttentionSublayerBackward")

    layers = MODERNBERT.num_hidden_layers
    assert attention_nodes() == layers
    assert attention_nodes(output_attentions=True) == 0
    with always_custom_op():
        assert attention_nodes() == 0
    handle = model.model.layers[1].attn.register_forward_hook(lambda *args: None)
    assert attention_nodes() == layers - 1  # the hooked attention's layer alone runs its ops
    handle.remove()
    model.model.layers[0].attn.Wo.register_forward_pre_hook(lambda *args: None)
    assert attention_nodes() == layers - 1
    model.config.backend = "torch"
    assert attention_nodes() == 0


@pytest.mark.parametrize("option", ["attention", "full"])
@pytest.mark.parametrize("architecture", ["bert", "mpnet", "modernbert"])
def test_recomputed_sublayer_gives_the_stored_gradients_bitwise(architecture, option, device):
    """Activation checkpointing reruns the node's forward in the backward: the same dropout masks and results
    (ModernBERT's pre-LN node returns two tensors, the LayerNorm's output and the stream; MPNet's reads the bias
    table)."""
    step = {"bert": _step, "mpnet": _mpnet_step, "modernbert": _modernbert_step}[architecture]
    _, loss, grads = step(device, per_op=False)
    _, recomputed_loss, recomputed = step(device, per_op=False, activation_checkpointing=option)
    assert torch.equal(loss, recomputed_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, recomputed[name]), name


# Plans one training step on meta tensors through the real launchers (fastbert.simulated.memory_plan) twice, with
# the nodes and with the ops one by one. The planner's MemoryTracker is a dispatch mode, under which the fused ops
# take their custom ops and no node runs (kernels/fused_op.eager_autograd); here the ops are told that no mode is
# on, so both plans run the eager path a user's step runs, with the tracker seeing every aten op below it.
_PLAN_BOTH_PATHS = """
import json, sys
import pytest, torch
import fastbert
from fastbert import family, modeling, ops, sublayer
from fastbert.kernels import fused_op
from fastbert.simulated.memory_plan import plan_step

name, options, qkv_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
rows, seqlen = 2, 32
resolve = ops.resolve_backend

def plan(per_op):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_op, "_dispatch_modes", lambda: 0)
        if qkv_path == "torch":  # as test_qkv_on_the_torch_path_is_in_the_node_with_the_per_op_results
            patch.setattr(ops, "resolve_backend", lambda backend, *tensors, op=None, **kw:
                          "torch" if op == "qkv_projection" else resolve(backend, *tensors, op=op, **kw))
        nodes = []
        patch.setattr(sublayer, "_APPLY", lambda *args, real=sublayer._APPLY: nodes.append(1) or real(*args))
        if per_op:
            patch.setattr(modeling.SelfAttention, "sublayer", lambda *args, **kwargs: None)
            for module in (modeling, family):
                patch.setattr(module, "fused_feed_forward_sublayer", lambda *args: None)
        with torch.device("meta"):
            if name == "bert":
                model = fastbert.BertForPreTraining(fastbert.BertConfig.tiny(**options))
            elif name == "mpnet":
                model = fastbert.MPNetForMaskedLM(fastbert.MPNetConfig.tiny(**options))
            else:
                model = fastbert.ModernBertForMaskedLM(fastbert.ModernBertConfig.tiny(**options))
            ids = torch.zeros(rows, seqlen, dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros_like(ids)}
            if name == "bert":
                batch["next_sentence_label"] = torch.zeros(rows, dtype=torch.long)
        result = plan_step(model, batch, optimizer="adamw", precision="bf16")
    return {"nodes": len(nodes), "peak": result.peak_bytes, "saved": result.saved_for_backward_bytes,
            "forward_end": result.forward_end_bytes, "phase_of_peak": result.phase_of_peak}

plan(per_op=True)  # the process's caches (launch placeholders, rotary frequencies) filled: neither plan counts them
print(json.dumps([plan(per_op=False), plan(per_op=True)]))
"""


BERT_OPTIONS = {"backend": "triton", "num_hidden_layers": 2, "hidden_dropout_prob": 0.1,
                "attention_probs_dropout_prob": 0.1}


@pytest.mark.parametrize("name, options, qkv_path", [
    ("bert", BERT_OPTIONS, "triton"), ("bert", BERT_OPTIONS, "torch"), ("mpnet", BERT_OPTIONS, "triton"),
    ("modernbert", {"backend": "triton", "num_hidden_layers": 2, "attention_dropout": 0.1}, "triton")],
    ids=["bert", "bert-qkv-torch-path", "mpnet", "modernbert"])
def test_a_step_with_the_nodes_holds_the_memory_of_the_ops_one_by_one(name, options, qkv_path):
    """A node keeps its saved tensors and the incoming gradient until its whole backward ends, where the per-op
    graph freed the LayerNorm's between its nodes: exact accounting on meta tensors (bf16 autocast, AdamW) finds the
    same saved bytes and the same peak to the byte, with the QKV projection on its kernel's path and on PyTorch's (the
    node saves what PyTorch's linear saves; the per-op backward's stacked copy of dq, dk and dv is not at the peak)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the launchers compile nothing on meta
    result = subprocess.run([sys.executable, "-c", _PLAN_BOTH_PATHS, name, json.dumps(options), qkv_path],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes, per_op = json.loads(result.stdout.splitlines()[-1])
    assert nodes["nodes"] == options["num_hidden_layers"] and per_op["nodes"] == 0
    assert nodes["phase_of_peak"] == per_op["phase_of_peak"] == "backward"
    for key in ("saved", "forward_end", "peak"):
        assert nodes[key] == per_op[key], key
