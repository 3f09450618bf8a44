"""`fastbert pretrain`: the loss falls, resume is exact, signals and non-finite steps are handled, bad
options are clear errors, and 2-process torchrun runs (DDP and FSDP2, gloo on CPU) match 1 process."""
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
import threading
import time

import pytest
import torch

from fastbert import BertConfig, BertForPreTraining
from fastbert.data import prepare
from fastbert.hf import read_state_dict
from fastbert.host_syncs import HostSyncCounter
from fastbert.modeling import BertPreTrainedModel
from fastbert.train import checkpoint, pretrain
from fastbert.train.optim import Lamb, build_optimizer, linear_warmup_decay
from tests.test_data import write_corpus

# a model small enough that a step takes milliseconds on CPU
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one torch thread per test process
SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 64}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# what a run computes, as opposed to how fast it went (tokens_per_s, mfu)
COMPUTED = ("step", "phase", "seq_length", "loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "lr",
            "grad_norm", "skipped_steps")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    corpus = write_corpus(root / "corpus.txt", documents=20, sentences=10)
    prepare.prepare_dataset([corpus], str(root / "data"), vocab_size=120, max_seq_lengths=(16, 32))
    return str(root / "data")


def config(data, out, **changes):
    values = dict(data=data, out=str(out), model="tiny", steps=6, batch_size=8, seq_lengths="16,32",
                  phase_fractions="0.5,0.5", log_every=1, progress=False, peak_tflops=1.0, device="cpu", lr=1e-3)
    return pretrain.PretrainConfig(**{**values, **changes})


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k in COMPUTED} for line in f]


def test_loss_falls(data, tmp_path):
    pretrain.train(config(data, tmp_path, steps=24, seq_lengths="16", phase_fractions="1", lr=5e-3, warmup=2),
                   {**SMALL, **NO_DROPOUT})
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 25))
    first, last = (sum(r["loss"] for r in part) / 4 for part in (records[:4], records[-4:]))
    assert last < first - 0.5
    assert all(0 <= r["mlm_accuracy"] <= 1 and 0 <= r["mlm_mask_accuracy"] <= 1 and r["tokens_per_s"] > 0
               and r["mfu"] > 0 for r in records)


def test_mask_token_accuracy_counts_the_mask_positions_alone():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.tiny(vocab_size=50, **NO_DROPOUT)).eval()
    ids = torch.randint(5, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    mask_id, labelled = 4, torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) < 0.5
    labelled[:, 15] = False
    shown_masked = labelled & (torch.arange(16) % 2 == 0)
    ids[shown_masked | (torch.arange(16) == 15)] = mask_id  # and an unlabelled [MASK] that must not count
    nsp = torch.tensor([0, 1, 1, 0])
    predicted = model(input_ids=ids, next_sentence_label=nsp, return_logits=True).prediction_logits.argmax(-1)
    # labels: right at half the [MASK] positions, wrong everywhere else
    right = shown_masked & (torch.arange(4)[:, None] % 2 == 0)
    labels = torch.where(right, predicted, (predicted + 1) % 50).masked_fill(~labelled, -100)
    plain = model(input_ids=ids, labels=labels, next_sentence_label=nsp)
    split = model(input_ids=ids, labels=labels, next_sentence_label=nsp, mask_token_id=mask_id)
    assert plain.mlm_mask_accuracy is None
    torch.testing.assert_close(split.mlm_loss, plain.mlm_loss)
    torch.testing.assert_close(split.mlm_accuracy, plain.mlm_accuracy)
    torch.testing.assert_close(split.mlm_mask_accuracy, right.sum() / shown_masked.sum())
    assert 0 < float(split.mlm_accuracy) < float(split.mlm_mask_accuracy) < 1
    with pytest.raises(ValueError, match="mask_token_id needs input_ids"):
        model(inputs_embeds=torch.zeros(1, 4, 128), mask_token_id=mask_id)


def test_resume_is_exact_and_checkpoints_are_pruned(data, tmp_path):
    whole = tmp_path / "whole"
    pretrain.train(config(data, whole, save_every=1, keep_checkpoints=2), SMALL)
    parts = tmp_path / "parts"
    first = pretrain.train(config(data, parts, stop_at=3), SMALL)  # stops at the phase boundary
    assert first["stopped"] and first["step"] == 3 and first["checkpoint"].endswith("step_00000003")
    second = pretrain.train(config(data, parts), SMALL)
    assert second["step"] == 6 and not second["stopped"]
    assert second["model"].config.max_predictions_per_seq == 0  # the loop's per-batch label budget is not left behind
    # fp32 on CPU: the resumed run's losses and weights are bitwise those of the uninterrupted one
    assert losses(parts) == losses(whole)
    final_whole = read_state_dict(os.path.join(whole, "checkpoints", "step_00000006", "model"))
    final_parts = read_state_dict(os.path.join(parts, "checkpoints", "step_00000006", "model"))
    assert final_whole.keys() == final_parts.keys()
    assert all(torch.equal(final_whole[k], final_parts[k]) for k in final_whole)
    assert sorted(os.listdir(whole / "checkpoints")) == ["step_00000005", "step_00000006"]
    _, info = BertForPreTraining.from_pretrained(os.path.join(whole, "checkpoints", "step_00000006", "model"),
                                                 output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    again = pretrain.train(config(data, parts), SMALL)  # a finished run is not run again
    assert again["step"] == 6 and losses(parts) == losses(whole)
    # its result is the finished run's: the model it wrote and the command that fine-tunes it
    assert "already complete at step 6" in again["report"][0]
    assert f"--model {os.path.join(parts, 'checkpoints', 'step_00000006', 'model')} " in again["report"][1]


def as_before_the_decoder_had_its_bias(step_directory):
    """Rewrite an untied run's trainer.pt as fastbert wrote it before its MLM decoder had a bias of its own: no
    parameter names, and the head's bias (which the logits added then) in the place of the decoder's."""
    from fastbert.train import state
    file = os.path.join(step_directory, state.TRAINER_FILE)
    trainer = torch.load(file, weights_only=False)
    names = trainer.pop("parameter_names")
    optimizer = trainer["optimizer"]
    exempt = optimizer["param_groups"][1]["params"]
    decoder, head = (exempt[names[1].index(name)] for name in ("cls.predictions.decoder.bias", "cls.predictions.bias"))
    assert head not in optimizer["state"]  # unused when untied: no gradient, no moments
    optimizer["state"][head] = optimizer["state"].pop(decoder)
    exempt.remove(decoder)
    torch.save(trainer, file)
    checkpoint.write_digests(step_directory)


def test_an_untied_run_saved_before_the_decoder_had_its_bias_resumes_exactly(data, tmp_path):
    """Its optimizer state had one parameter fewer, which torch refused ("a parameter group that doesn't match
    the size of optimizer's group"): the head bias's moments are the decoder bias's now."""
    untied = {**SMALL, "tie_word_embeddings": False}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    pretrain.train(config(data, whole), untied)
    first = pretrain.train(config(data, parts, stop_at=3), untied)
    as_before_the_decoder_had_its_bias(first["checkpoint"])
    pretrain.train(config(data, parts), untied)
    assert losses(parts) == losses(whole)
    final = [read_state_dict(os.path.join(run, "checkpoints", "step_00000006", "model")) for run in (whole, parts)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_an_untied_run_from_a_config_file_resumes_from_a_run_json_that_did_not_record_the_tie(data, tmp_path):
    """An older run.json's fingerprint lacks tie_word_embeddings: taken as True, it refused to resume an untied run
    whose --model file (not a --model.* flag) untied the head. The checkpoint's model/config.json says what ran."""
    from fastbert.train.checkpoint import RUN_FILE
    model_file = tmp_path / "untied.json"
    model_file.write_text(json.dumps({"model_type": "bert", "vocab_size": 120, **SMALL, "tie_word_embeddings": False}))
    run = tmp_path / "run"
    first = pretrain.train(config(data, run, model=str(model_file), stop_at=3))
    record = json.loads((Path(first["checkpoint"]) / RUN_FILE).read_text())
    del record["fingerprint"]["model"]["tie_word_embeddings"]  # as fastbert wrote it before recording the field
    (Path(first["checkpoint"]) / RUN_FILE).write_text(json.dumps(record))
    checkpoint.write_digests(first["checkpoint"])
    assert pretrain.train(config(data, run, model=str(model_file)))["step"] == 6


def test_a_checkpoint_is_written_while_the_loop_goes_on(data, tmp_path, monkeypatch):
    """A save costs the loop the copy of the state to host memory, nothing more: the files of step s's
    checkpoint are written only once step s + 2 has begun (a save that wrote in the loop would wait for
    it forever), and they hold step s's weights, not the ones the loop has moved on to."""
    weights_before_step = []  # [i]: the weights when step i + 1 begins
    step, save = pretrain.train_step, checkpoint.save_checkpoint

    def recording_step(run, *args, **kwargs):
        weights_before_step.append({n: p.detach().clone() for n, p in run.model.named_parameters()})
        return step(run, *args, **kwargs)

    def save_once_the_loop_is_two_steps_on(root, saved_step, *args, **kwargs):
        deadline = time.monotonic() + 30
        while saved_step < 6 and len(weights_before_step) < saved_step + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        written_at.append((saved_step, len(weights_before_step)))
        return save(root, saved_step, *args, **kwargs)

    written_at = []
    monkeypatch.setattr(pretrain, "train_step", recording_step)
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_once_the_loop_is_two_steps_on)
    pretrain.train(config(data, tmp_path, save_every=2, keep_checkpoints=3), SMALL)
    assert written_at == [(2, 4), (4, 6), (6, 6)]
    for saved_step in (2, 4):
        saved = read_state_dict(os.path.join(tmp_path, "checkpoints", f"step_{saved_step:08d}", "model"))
        expected = weights_before_step[saved_step]
        assert not torch.equal(expected["bert.pooler.dense.weight"],
                               weights_before_step[saved_step + 1]["bert.pooler.dense.weight"])
        assert all(torch.equal(saved[name], expected[name]) for name in expected)


def test_a_resume_builds_the_model_on_the_meta_device(data, tmp_path, monkeypatch):
    """The weights a checkpoint is about to replace are never randomly initialised first."""
    pretrain.train(config(data, tmp_path, stop_at=2), SMALL)
    initialised, init = [], BertPreTrainedModel._init_weights
    monkeypatch.setattr(BertPreTrainedModel, "_init_weights",
                        lambda self, module: initialised.append(type(module).__name__) or init(self, module))
    assert pretrain.train(config(data, tmp_path, steps=3), SMALL)["step"] == 3  # resumed at step 2
    assert initialised == []
    pretrain.train(config(data, tmp_path / "fresh", steps=1), SMALL)
    assert "Linear" in initialised  # a fresh run does initialise


def test_non_finite_steps_are_skipped_then_stop_the_run(data, tmp_path, monkeypatch):
    forward = BertForPreTraining.forward
    poisoned = set()

    def nan_forward(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        calls = nan_forward.calls = getattr(nan_forward, "calls", 0) + 1
        if calls in poisoned:
            output.mlm_loss = output.mlm_loss * float("nan")
        return output

    monkeypatch.setattr(BertForPreTraining, "forward", nan_forward)
    poisoned.update({2})
    result = pretrain.train(config(data, tmp_path / "one", steps=4), SMALL)
    assert result["step"] == 4 and result["skipped_steps"] == 1
    assert [r["skipped_steps"] for r in losses(tmp_path / "one")] == [0, 1, 1, 1]
    nan_forward.calls = 0
    poisoned.update(range(100))
    with pytest.raises(pretrain.TrainingError, match="3 consecutive steps"):
        pretrain.train(config(data, tmp_path / "all", steps=6, max_bad_steps=3), SMALL)


@pytest.mark.parametrize("argv,message", [
    (["--data", "/nonexistent/data"], "is not a directory"),
    (["--keep-checkpoints", "1"], "--keep-checkpoints must be >= 2"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--model.hidden_sise", "8"], "no field 'hidden_sise'"),
    (["--seq-lengths", "128,512"], "must be in [5, 128], the longest sequence the model's max_position_embeddings"),
    (["--batch-size", "8", "--micro-batch-size", "3"], "must divide"),
    # infinities passed the > 0 / >= 0 checks: a traceback (--warmup), a run that trained nothing (--eps)
    (["--warmup", "inf"], "--warmup must be finite and >= 0, got inf"),
    (["--eps", "inf"], "--eps must be finite and > 0, got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be finite and >= 0, got inf"),
    (["--lr", "inf"], "--lr must be finite and > 0, got inf"),
    (["--phase-fractions", "nan,1", "--seq-lengths", "16,32"], "--phase-fractions 'nan,1' must be 2 non-negative"),
    (["--mask-prob", "0"], "--mask-prob must be in (0, 1), got 0.0"),
    (["--model.type_vocab_size", "1"], "--model.type_vocab_size 1 cannot hold --objective mlm+nsp's second"),
    (["--model.type_vocab_size", "0"], "--model.type_vocab_size 0 cannot hold --objective mlm+nsp's second"),
])
def test_bad_options_are_clear_errors(tmp_path, capsys, argv, message):
    assert pretrain.main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "fastbert pretrain: error: " in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("values,message", [
    ({"lr": "1e-3"}, "--lr must be a number, got '1e-3'"),
    ({"steps": "3"}, "--steps must be an integer, got '3'"),
    ({"steps": 3.0}, "--steps must be an integer, got 3.0"),
    ({"seq_lengths": 16}, "--seq-lengths must be a string, got 16"),
    ({"whole_word_masking": "false"}, "--whole-word-masking must be true or false, got 'false'"),
])
def test_config_file_values_of_another_type_are_clear_errors(tmp_path, capsys, values, message):
    """--config's JSON values are not typed by argparse: a string for a number was a traceback, and "false" for a
    switch turned it on."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(values))
    assert pretrain.main(["--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "a-file").write_text("kept")
    assert pretrain.main(["--out", str(tmp_path / "a-file")]) == 2
    assert f"--out {tmp_path / 'a-file'} is a file; the run writes a directory there" in capsys.readouterr().err
    assert (tmp_path / "a-file").read_text() == "kept"


def test_an_out_holding_a_model_is_refused_untouched(data, tmp_path, capsys):
    """A model directory as --out: the run wrote its own config.json over the model's and exited 0."""
    model_directory = tmp_path / "model"
    BertForPreTraining(BertConfig(vocab_size=120, **SMALL)).save_pretrained(model_directory)
    before = (model_directory / "config.json").read_text()
    assert pretrain.main(["--data", data, "--out", str(model_directory), "--model", "tiny", "--steps", "1",
                          "--seq-lengths", "16", "--phase-fractions", "1", "--device", "cpu"]) == 2
    assert "holds a model (model.safetensors), not a pretraining run" in capsys.readouterr().err
    assert (model_directory / "config.json").read_text() == before and not (model_directory / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_backend_the_device_cannot_run_is_refused_before_the_run(data, tmp_path, capsys, monkeypatch):
    """--model.backend triton on a CPU was a traceback at the first step, after the run directory was written."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernels on CPU
    monkeypatch.delenv("FASTBERT_BACKEND", raising=False)
    assert pretrain.main(["--data", data, "--out", str(tmp_path / "run"), "--model", "tiny", "--seq-lengths", "16",
                          "--phase-fractions", "1", "--device", "cpu", "--model.backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "--model.backend triton cannot run on the device here, cpu" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_missing_phase_data_is_a_clear_error(data, tmp_path, capsys):
    assert pretrain.main(["--data", data, "--out", str(tmp_path), "--seq-lengths", "16,64"]) == 2
    assert "no dataset with max_seq_length 64" in capsys.readouterr().err


def test_lamb_step_matches_its_formula():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    w.grad = torch.randn(5, 3)
    start, grad = w.detach().clone(), w.grad.clone()
    Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01).step()
    m, v = 0.1 * grad / 0.1, 0.01 * grad ** 2 / 0.01  # bias-corrected first step
    r = m / (v.sqrt() + 1e-6) + 0.01 * start
    expected = start - 0.1 * start.norm() / r.norm() * r
    torch.testing.assert_close(w.detach(), expected)


def lamb_per_tensor(weights, grads_per_step, lr, betas, eps, decays):
    """LAMB one tensor at a time, straight from its formula (optim.py's docstring)."""
    weights = [w.clone() for w in weights]
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    for t, grads in enumerate(grads_per_step, start=1):
        for w, g, (m, v), decay in zip(weights, grads, moments, decays):
            m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps) + decay * w
            trust = w.norm() / r.norm() if w.norm() > 0 and r.norm() > 0 else 1.0
            w.sub_(lr * trust * r)
    return weights


SHAPES = [(7, 3), (5,), (1,), (0,), (4, 4), (2, 3, 2)]


def lamb_problem(steps=4):
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=generator) for s in SHAPES]
    weights[4].zero_()  # a zero tensor: trust ratio 1
    grads = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(steps)]
    return weights, grads


def lamb_of(weights, decay=0.01, lr=0.1):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    return params, Lamb([{"params": params[:3], "weight_decay": decay}, {"params": params[3:], "weight_decay": 0.0}],
                        lr=lr, betas=(0.9, 0.99), eps=1e-6)


def test_multi_tensor_lamb_equals_the_per_tensor_formula():
    weights, grads = lamb_problem()
    params, optimizer = lamb_of(weights)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    expected = lamb_per_tensor(weights, grads, 0.1, (0.9, 0.99), 1e-6, [0.01] * 3 + [0.0] * 3)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e)  # fp32 rounding (rtol 1.3e-6)


def test_lamb_skips_on_found_inf_without_touching_weights_or_moments():
    weights, grads = lamb_problem(steps=2)
    params, optimizer = lamb_of(weights)
    clean_params, clean = lamb_of(weights)
    for step, step_grads in enumerate(grads):
        for p, q, g in zip(params, clean_params, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.found_inf = torch.tensor(0.0)
        optimizer.step()
        clean.step()
        if step == 0:  # then a bad step: non-finite gradients, skipped on the device
            for p, g in zip(params, step_grads):
                p.grad = torch.full_like(g, float("nan"))
            params[0].grad[0, 0] = float("inf")
            optimizer.found_inf = torch.tensor(1.0)
            optimizer.step()
    for p, q in zip(params, clean_params):  # bitwise: as if the bad step had never happened
        assert torch.equal(p, q)
        assert all(torch.equal(optimizer.state[p][k], clean.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_lamb_step_is_at_most_400_ops_for_bert_base():
    # BERT-base's tensors (12 layers, the heads) at tiny widths: the op count depends on the number of
    # tensors only; the per-tensor LAMB took 3,058 ops here
    base = BertConfig.base(hidden_size=12, intermediate_size=12, vocab_size=16, max_position_embeddings=8)
    model = BertForPreTraining(base)
    optimizer = build_optimizer(model, "lamb", 1e-3, (0.9, 0.999), 1e-6, 0.01, sharded=False)
    assert isinstance(optimizer, Lamb) and len(list(model.parameters())) > 150
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates the state
    optimizer.found_inf = torch.tensor(0.0)  # as the training loop steps it
    with OpCounter() as counter:
        optimizer.step()
    assert counter.ops <= 400


def test_warmup_then_linear_decay():
    factor = linear_warmup_decay(4, 14)
    assert [factor(s) for s in (0, 3, 4, 9, 14)] == [0.25, 1.0, 1.0, 0.5, 0.0]


def _run_cli(args, **kwargs):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-m", "fastbert.cli", "pretrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_a_steady_state_step_never_syncs_with_the_host(data, tmp_path, optimizer):
    def syncs(steps, log_every):
        out = tmp_path / str(len(os.listdir(tmp_path)))  # a fresh run each time
        with HostSyncCounter() as counter:
            pretrain.train(config(data, out, steps=steps, log_every=log_every,
                                  seq_lengths="16", phase_fractions="1", micro_batch_size="4", optimizer=optimizer),
                           SMALL)
        return counter.syncs

    # set-up, the last metrics line and the final checkpoint are the same in both runs: 3 more steps
    # (2 micro-batches each, the model's input checks on) add no wait
    few_lines = syncs(steps=6, log_every=6)
    assert few_lines == syncs(steps=3, log_every=3)
    # what it counts: each of the 5 more metrics lines sends the host's counts and reads the sums back
    assert syncs(steps=6, log_every=1) == few_lines + 2 * 5


def _cli_args(data, out, steps):
    args = ["--data", data, "--out", str(out), "--steps", str(steps), "--batch-size", "8", "--seq-lengths", "16",
            "--phase-fractions", "1", "--log-every", "1", "--no-progress", "--peak-tflops", "1", "--device", "cpu"]
    return args + [x for k, v in SMALL.items() for x in (f"--model.{k}", str(v))]


@pytest.mark.slow(reason="four end-to-end pretraining runs in their own processes")
def test_runs_exit_cleanly_when_finished_or_sigtermed(data, tmp_path):
    """Status 0 every time: never 134, the abort of a prefetch thread still in torch code at exit."""
    for round in range(2):  # each round: a run to its end and a SIGTERMed one, side by side
        finished = _run_cli(_cli_args(data, tmp_path / f"done{round}", 3))
        out = tmp_path / f"term{round}"
        signalled = _run_cli(_cli_args(data, out, 100000))
        metrics, deadline = out / "metrics.jsonl", time.time() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(0.2)
        signalled.send_signal(signal.SIGTERM)
        output, _ = finished.communicate(timeout=120)
        assert finished.returncode == 0 and "done: 3 steps" in output, output
        output, _ = signalled.communicate(timeout=120)
        assert signalled.returncode == 0, output
        assert "stopped at step" in output and "(signal)" in output and "Traceback" not in output
        step = int(output.split("stopped at step ")[1].split()[0])
        assert step >= 2 and losses(out)[-1]["step"] == step
        saved = out / "checkpoints" / f"step_{step:08d}"
        assert (saved / "trainer.pt").exists() and (saved / "model" / "model.safetensors").exists()
        assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".tmp")]
        assert torch.load(saved / "trainer.pt", weights_only=False)["step"] == step


def test_prefetch_thread_is_joined_on_every_exit(data, tmp_path, monkeypatch):
    def prefetching():
        return [t.name for t in threading.enumerate() if t.name == "fastbert-prefetch"]

    pretrain.train(config(data, tmp_path / "done", steps=2, seq_lengths="16", phase_fractions="1"), SMALL)
    assert not prefetching()
    pretrain.train(config(data, tmp_path / "stopped", stop_at=1), SMALL)
    assert not prefetching()
    forward = BertForPreTraining.forward

    def failing_forward(self, *args, **kwargs):
        failing_forward.calls = getattr(failing_forward, "calls", 0) + 1
        if failing_forward.calls == 2:
            raise RuntimeError("a failing forward")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(BertForPreTraining, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="a failing forward"):
        pretrain.train(config(data, tmp_path / "failed"), SMALL)
    assert not prefetching()


WORKER = textwrap.dedent("""
    import dataclasses, json, sys, torch, torch.distributed as dist
    from fastbert.train import pretrain
    data, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    for strategy, optimizer in (("ddp", "adamw"), ("fsdp", "lamb")):
        cfg = pretrain.PretrainConfig(data=data, out=f"{out}/{strategy}", model="tiny", steps=4, batch_size=8,
                                      micro_batch_size="2", seq_lengths="16", phase_fractions="1", log_every=1,
                                      progress=False, peak_tflops=1.0, device="cpu", lr=1e-3,
                                      distributed=strategy, optimizer=optimizer)
        if strategy == "fsdp":  # stopped and resumed: a sharded checkpoint, written and read by 2 ranks
            pretrain.train(dataclasses.replace(cfg, stop_at=2), overrides)
        model = pretrain.train(cfg, overrides)["model"]
        flat = torch.cat([getattr(p, "full_tensor", lambda: p)().detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        if dist.get_rank() == 0:
            same = all(torch.equal(g, gathered[0]) for g in gathered)
            json.dump({"identical": same}, open(f"{out}/{strategy}/ranks.json", "w"))
    dist.destroy_process_group()
""")


def assert_same_losses(two, one, what):
    for a, b in zip(two, one, strict=True):
        assert a["step"] == b["step"]
        for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (what, a["step"], key)


@pytest.mark.slow(reason="end-to-end pretraining runs under torchrun, two processes and one")
def test_torchrun_two_processes_match_one(data, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    overrides = {**SMALL, **NO_DROPOUT}
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(worker), data, str(tmp_path), json.dumps(overrides)],
                         capture_output=True, text=True, env=env, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for strategy, optimizer in (("ddp", "adamw"), ("fsdp", "lamb")):
        assert json.load(open(tmp_path / strategy / "ranks.json"))["identical"]
        single = tmp_path / f"single-{strategy}"
        # one process, the same global batch of 8 in micro-batches of 4 (2 ranks x micro-batches of 2 above)
        pretrain.train(config(data, single, steps=4, micro_batch_size="4", seq_lengths="16", phase_fractions="1",
                              optimizer=optimizer), overrides)
        assert [r["step"] for r in losses(tmp_path / strategy)] == [1, 2, 3, 4]
        assert_same_losses(losses(tmp_path / strategy), losses(single), strategy)
    # FSDP2's checkpoints: each rank wrote its shards (no gathering); the whole model only at the end
    stopped = tmp_path / "fsdp" / "checkpoints" / "step_00000002"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(stopped / "sharded"))
    assert not (stopped / "model").exists() and (tmp_path / "fsdp" / "checkpoints" / "step_00000004" / "model").exists()
    # the 2-rank sharded checkpoint resumes in one process (resharded), weights and LAMB moments
    resharded = tmp_path / "resharded"
    pretrain.train(config(data, resharded, steps=4, micro_batch_size="4", seq_lengths="16", phase_fractions="1",
                          optimizer="lamb", resume=str(stopped)), overrides)
    assert_same_losses(losses(resharded), losses(tmp_path / "fsdp")[2:], "resharded")


def test_fp16_loss_scaling_runs_and_is_checkpointed(data, tmp_path):
    result = pretrain.train(config(data, tmp_path, steps=3, precision="fp16", seq_lengths="16", phase_fractions="1"),
                            SMALL)
    assert result["step"] == 3
    state = torch.load(os.path.join(result["checkpoint"], "trainer.pt"), weights_only=False)
    assert state["scaler"]["scale"] > 0 and state["bad_steps_in_row"] == 0
    assert all(r["loss"] is not None and r["loss"] > 0 for r in losses(tmp_path))


def test_the_demo_is_a_preset_that_naming_a_default_keeps(tmp_path):
    from fastbert.train.options import DEMO_MODEL, DEMO_OPTIONS, PretrainConfig, parse_args
    cfg, overrides = parse_args([], "")
    assert {k: getattr(cfg, k) for k in DEMO_OPTIONS} == DEMO_OPTIONS and overrides == DEMO_MODEL
    for named_defaults in (["--data", "stdlib"], ["--model", "tiny"], ["--preset", "demo"], ["--preset", "auto"]):
        assert parse_args(named_defaults, "") == (cfg, overrides), named_defaults
    cfg, overrides = parse_args(["--lr", "5e-4", "--model.hidden_dropout_prob", "0.1"], "")  # flags win
    assert cfg.lr == 5e-4 and cfg.steps == DEMO_OPTIONS["steps"] and overrides["hidden_dropout_prob"] == 0.1
    # the user's corpus, or --preset paper: the paper's recipe, the defaults --help shows
    assert parse_args(["--data", str(tmp_path)], "") == (PretrainConfig(data=str(tmp_path)), {})
    assert parse_args(["--preset", "paper"], "") == (PretrainConfig(), {})
    # the demo's model changes are the tiny model's: a model of the user's keeps its own sizes
    cfg, overrides = parse_args(["--model", "base"], "")
    assert cfg.steps == DEMO_OPTIONS["steps"] and overrides == {}
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"preset": "paper", "steps": 7}))
    assert parse_args(["--config", str(config)], "") == (PretrainConfig(steps=7), {})


def test_preparing_a_directory_again_names_only_the_options_it_ignores(data, caplog):
    from fastbert.data.shards import ShardedDataset
    caplog.set_level("INFO", logger="fastbert")
    corpus = os.path.join(os.path.dirname(data), "corpus.txt")
    size = ShardedDataset(os.path.join(data, "seq16")).vocab_size
    for options, ignored in (({}, None), ({"vocab_size": size}, None),
                             ({"vocab_size": size + 1}, f"--vocab-size {size + 1}"), ({"lowercase": False}, "--cased")):
        caplog.clear()
        prepare.prepare_dataset([corpus], data, max_seq_lengths=(16,), **options)
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizer: "))
        expected = "other datasets" if ignored is None else f"(ignored here, for a new --out: {ignored})"
        assert line.endswith(expected), line


def test_help_shows_the_real_defaults_the_demos_values_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_code:
        pretrain.main(["--help"])
    assert exit_code.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    from fastbert.train.options import DEMO_OPTIONS, PretrainConfig
    for name, demo in DEMO_OPTIONS.items():
        assert f"(default: {getattr(PretrainConfig, name)!r}; demo: {demo!r})" in text, name
    for flag in ("--optimizer {adamw,lamb}", "--precision {auto,fp32,bf16,fp16}", "--device {auto,cpu,cuda}",
                 "--distributed {ddp,fsdp}", "--preset {auto,demo,paper}"):
        assert flag in text
    assert "options.py" not in text and "run.py" not in text  # no notes for developers


def test_threads_hold_for_the_run_only(data, tmp_path, monkeypatch):
    seen, step = [], pretrain.train_step
    monkeypatch.setattr(pretrain, "train_step", lambda *args: seen.append(torch.get_num_threads()) or step(*args))
    before = torch.get_num_threads()
    pretrain.train(config(data, tmp_path, steps=2, threads=before + 1, seq_lengths="16", phase_fractions="1"), SMALL)
    assert seen == [before + 1] * 2 and torch.get_num_threads() == before


def chance_levels(dataset) -> tuple[float, float, float]:
    """What a model that learned nothing from the inputs scores on this data: the NSP accuracy of always
    answering the more common label, the MLM accuracy of always answering the most common token; and the
    mean number of tokens per example that masking may pick (all but [CLS] and [SEP]s)."""
    import numpy as np
    counts, labels, maskable = np.zeros(dataset.vocab_size, dtype=np.int64), [], []
    specials = [dataset.special_ids[name] for name in ("cls", "sep")]
    for i in range(len(dataset)):
        tokens, _, label = dataset[i]
        tokens = tokens[~np.isin(tokens, specials)]
        counts += np.bincount(tokens, minlength=dataset.vocab_size)
        labels.append(label)
        maskable.append(len(tokens))
    return max(np.mean(labels), 1 - np.mean(labels)), counts.max() / counts.sum(), float(np.mean(maskable))


DEMO_TEST_STEPS = 300  # the demo shortened (its warm-up and decay scaled along): about 35 CPU-seconds of training


@pytest.mark.slow(reason="the demo pretraining run, shortened to 300 steps, and a fine-tuning run")
def test_the_demo_learns(tmp_path, monkeypatch, capsys):
    """The demo, run as the README says but shorter, scores above what a model that does not learn
    scores, by 4 standard errors of the predictions the compared rows hold; its last line names the model
    and the tokenizer, and its fine-tuning command takes them."""
    from fastbert.data.shards import ShardedDataset
    from fastbert.finetune import cli as finetune_cli
    from fastbert.train.options import parse_args
    monkeypatch.setenv("FASTBERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert pretrain.main(["--steps", str(DEMO_TEST_STEPS), "--no-progress", "--peak-tflops", "1"]) == 0
    output = capsys.readouterr()
    # the results on stdout, the progress on stderr; no MFU against a CPU
    results = output.out.splitlines()
    assert len(results) == 2 and results[0].startswith(f"done: {DEMO_TEST_STEPS} steps (last logged: loss "), results
    assert "done: " not in output.err and "pretraining BERT" in output.err and "MFU" not in output.out + output.err
    with open(tmp_path / "runs" / "tiny-stdlib" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    last = rows[-len(rows) // 10:]
    mean = {k: sum(r[k] for r in last) / len(last) for k in ("mlm_accuracy", "mlm_mask_accuracy", "nsp_accuracy")}
    cfg = parse_args([], "")[0]  # the demo's
    dataset = os.path.join(prepare.builtin_dir(BertConfig.tiny().vocab_size), f"seq{cfg.seq_lengths}")
    nsp_chance, unigram, maskable = chance_levels(ShardedDataset(dataset))
    sequences = len(last) * cfg.log_every * cfg.batch_size
    labelled = sequences * maskable * cfg.mask_prob
    nsp_floor = nsp_chance + 4 * (nsp_chance * (1 - nsp_chance) / sequences) ** 0.5
    mlm_floor = unigram + 4 * (unigram * (1 - unigram) / labelled) ** 0.5
    assert mean["nsp_accuracy"] > nsp_floor and mean["mlm_accuracy"] > mlm_floor, (mean, nsp_floor, mlm_floor)
    assert 0 < mean["mlm_mask_accuracy"] < mean["mlm_accuracy"], mean  # the latter counts tokens shown as they are
    hint = output.out.splitlines()[-1]  # the last line: where the model is and how to fine-tune it
    command = shlex.split(hint.split("fine-tune it with: ")[1].split(" (")[0])
    assert command[:2] == ["fastbert", "finetune"], hint
    model = command[command.index("--model") + 1]
    assert model == os.path.join("runs", "tiny-stdlib", "checkpoints", f"step_{DEMO_TEST_STEPS:08d}", "model")
    with open("train.tsv", "w") as f:
        f.write("sentence\tlabel\n" + "".join(f"{w} of the module\t{w[0]}\n" for w in ("abs", "bool", "all", "bin")))
    with open("dev.tsv", "w") as f:
        f.write("sentence\tlabel\nany of the module\ta\n")
    assert finetune_cli.main(command[2:] + ["--max-steps", "1", "--no-progress"]) == 0
    assert os.path.isfile(os.path.join("finetuned", "config.json"))


# DDP on one gloo process: wrap() is told there are two ranks, so that it wraps
UNTIED_UNDER_DDP = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from fastbert import BertConfig, BertForPreTraining
    from fastbert.train import distributed
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, tie_word_embeddings=False)
    model = distributed.wrap(BertForPreTraining(config), "ddp", distributed.Dist(world_size=2), None)
    ids = torch.randint(5, 100, (2, 8))
    for step in range(2):
        model(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(2, dtype=torch.long)).loss.backward()
    print("two steps")
    dist.destroy_process_group()
""")


def test_ddp_trains_an_untied_mlm_head(tmp_path):
    """With tie_word_embeddings=False the head's own bias is unused (the logits add the decoder's, as in
    transformers): DDP waited for its gradient and failed the second step ("Expected to have finished reduction")."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", UNTIED_UNDER_DDP], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PORT": str(port)})
    assert run.returncode == 0 and "two steps" in run.stdout, run.stderr[-2000:]
