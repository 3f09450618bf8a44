"""`fastbert bench --suite memory` around the plan (fastbert.simulated.memory_plan, tested on its own): the exact
largest-batch search, the FSDP2 column, the CLI's table against plan_step, PERF.md's section, and
`fastbert pretrain --micro-batch-size auto` (refused off a GPU; its choice with an injected free memory)."""
import json
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import fastbert
from fastbert.bench import memory_cases, memory_report
from fastbert.simulated import device_fit
from fastbert.simulated.device_fit import GiB, Reserve, fits, largest_batch

RESERVE = Reserve(fixed_bytes=GiB, fraction=0.1)
DEVICE = 80 * GiB


def _brute_force(peak_of, limit):
    return max([0] + [b for b in range(1, limit + 1) if fits(peak_of(b), DEVICE, RESERVE)])


@pytest.mark.parametrize("fixed, per_sequence, wobble", [
    (10 * GiB, 130_000_000, 0),  # affine
    (2 * GiB, 70_000_000, 3_000_000),  # affine up to a few rounded buffers
    (30 * GiB, 400_000_000, 0),
])
def test_largest_batch_is_exact_in_few_plans(fixed, per_sequence, wobble):
    calls = []

    def peak_of(b):
        calls.append(b)
        return fixed + per_sequence * b + wobble * (b % 3)

    got, plans = largest_batch(peak_of, DEVICE, RESERVE, known={64: peak_of(64)}, limit=1 << 16)
    assert plans == len(calls) - 1 <= 4  # batch 1, the guess and its neighbour (and one more when rounded off)
    assert got == _brute_force(peak_of, 5000)


def test_largest_batch_past_the_optimizer_steps_floor_takes_three_plans():
    def peak_of(b):  # small batches peak in the optimizer step (state alone), larger ones in the backward
        return max(GiB, 100_000_000 * b - GiB)

    got, plans = largest_batch(peak_of, DEVICE, RESERVE, known={64: peak_of(64)}, limit=1 << 16)
    assert (got, plans) == (_brute_force(peak_of, 2000), 3)  # batch 32, the line's crossing and the next batch


def test_largest_batch_off_the_line_is_still_exact():
    def peak_of(b):  # a jump the line from two plans cannot see
        return 5 * GiB + 100_000_000 * b + (50 * GiB if b > 300 else 0)

    got, _ = largest_batch(peak_of, DEVICE, RESERVE, known={64: peak_of(64)}, limit=1 << 16)
    assert got == _brute_force(peak_of, 2000) == 300


def test_largest_batch_limits():
    assert largest_batch(lambda b: 79 * GiB + b, DEVICE, RESERVE) == (0, 1)  # not even one sequence
    assert largest_batch(lambda b: GiB + b, DEVICE, RESERVE, limit=24)[0] == 24  # all fit up to the limit


def test_reserve_keeps_the_fixed_part_and_the_fraction():
    assert RESERVE.needed(10 * GiB) == GiB + 11 * GiB
    assert fits(int((DEVICE - GiB) / 1.1), DEVICE, RESERVE) and not fits(int((DEVICE - GiB) / 1.1) + 16, DEVICE,
                                                                           RESERVE)


def test_fsdp2_shards_the_state_and_gathers_two_layers_and_the_root():
    config = fastbert.BertConfig.tiny(num_hidden_layers=4)
    with torch.device("meta"):
        model = fastbert.BertForPreTraining(config)
    layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    gathered = device_fit.gathered_parameters(model)
    assert gathered == total - 2 * layer  # the root and 2 of the 4 layers
    memory = SimpleNamespace(peak_bytes=1000, peak_breakdown={"weights": 200, "gradients": 200, "optimizer": 400,
                                                              "activations": 150, "transients": 50})
    assert device_fit.fsdp2_per_rank(memory, 10, 4) == 200 + 800 // 4 + 2 * 10


def _tiny_config(tmp_path):
    path = tmp_path / "config.json"
    fastbert.BertConfig.tiny().to_json(path)
    return str(path)


def _without_interpreter(code: str) -> dict:
    """Run code in a new Python without TRITON_INTERPRET (conftest sets it; a plan runs the compiled kernels'
    launchers, which the interpreter replaces) and return the JSON its last line of stdout prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_provider_holds_the_same_batch():
    """transformers' forward is not given the all-ones mask (it would read its data to drop it), but the caller
    holds it all the same: each provider's plan counts the same inputs, so a peak compares the models alone."""
    got = _without_interpreter("""
        import json
        from fastbert.bench import memory_cases
        inputs = {}
        for mode, optimizer in (("inference", None), ("finetune", "adamw")):
            case = memory_cases.MemoryCase(mode, "tiny", 32, 4, optimizer)
            for provider in case.providers:
                inputs[f"{mode} {provider}"] = memory_cases.plan(case, provider, 4).peak_breakdown["inputs"]
        print(json.dumps(inputs))
    """)
    assert len(got) == 6 and len(set(got[k] for k in got if k.startswith("inference"))) == 1, got
    assert len(set(got[k] for k in got if k.startswith("finetune"))) == 1, got


def test_encoder_saved_bytes_are_its_layers_and_what_the_encoder_keeps_itself():
    """Under full activation checkpointing the encoder's own forward keeps each layer's input (torch's
    checkpoint saves it there): those bytes are the encoder's too; the embeddings' and the heads' are not."""
    saved = {"bert.encoder.layer.0.attention.self": 5, "bert.encoder.layer.1": 6, "bert.encoder": 10,
             "encoder": 3, "bert.embeddings": 7, "cls.predictions.transform": 11, "bert.encoder_twin": 13}
    assert memory_cases.encoder_saved_bytes(saved) == 5 + 6 + 10 + 3


def test_cli_table_is_plan_step(tmp_path):
    got = _without_interpreter(f"""
        import contextlib, dataclasses, io, json
        from fastbert.bench import memory_cases
        from fastbert.bench.cli import main
        from fastbert.simulated.memory_plan import plan_step

        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            code = main(["--suite", "memory", "--model", {_tiny_config(tmp_path)!r}, "--seq-length", "32",
                         "--batch", "4"])
        case = memory_cases.user_case({_tiny_config(tmp_path)!r}, 32, 4)
        memory = plan_step(memory_cases.build_model(case, "fastbert"), memory_cases.make_inputs(case, 4),
                           mode="train", optimizer="adamw", precision="bf16")
        print(json.dumps({{"code": code, "table": table.getvalue(), "plan": dataclasses.asdict(memory)}}))
    """)
    assert got["code"] == 0
    table, expected = got["table"], got["plan"]

    def figure(label):
        match = re.search(rf"^{re.escape(label)}\s+([\d,]+)\s", table, re.MULTILINE)
        assert match, f"no line {label!r} in\n{table}"
        return int(match.group(1).replace(",", ""))

    assert figure(f"peak (in the {expected['phase_of_peak']})") == expected["peak_bytes"]
    assert figure("live at the end of the forward") == expected["forward_end_bytes"]
    assert figure("  of which saved for the backward") == expected["saved_for_backward_bytes"]
    assert (figure("weights"), figure("gradients"), figure("optimizer state")) == (
        expected["weights_bytes"], expected["gradients_bytes"], expected["optimizer_bytes"])
    for category, value in expected["peak_breakdown"].items():
        assert figure(f"  at the peak: {category}") == value
    layers = memory_cases.encoder_saved_bytes(expected["saved_by_module"])
    assert figure("  of which saved by the encoder's layers") == layers > 0
    per_layer = layers / (4 * 32 * 2)  # tokens x layers
    assert f"saved bytes per token per layer: {per_layer:,.1f} = {per_layer / 128:.2f}·s·b·h" in table


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--seq-length", "32"], "needs --seq-length S and --batch B"),
    (["--model", "tiny", "--seq-length", "129", "--batch", "2"], "--seq-length must be in [1, max_position"),
    (["--model", "tiny", "--seq-length", "32", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["--model", "no/such.json", "--seq-length", "32", "--batch", "2"], "--model must be one of"),
])
def test_cli_refuses_bad_plan_arguments(argv, message, capsys):
    from fastbert.cli import main

    assert main(["bench", "--suite", "memory", *argv]) == 2
    assert message in capsys.readouterr().err


def test_pretrain_auto_micro_batch_needs_a_gpu(tmp_path, capsys):
    from fastbert.cli import main

    code = main(["pretrain", "--model", "tiny", "--device", "cpu", "--micro-batch-size", "auto", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--micro-batch-size auto" in err and "GPU" in err and "'cpu'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow(reason="plans the tiny model's training step at many batch sizes in a fresh process")
def test_auto_micro_batch_is_the_largest_divisor_that_the_plan_fits(tmp_path):
    checkpoint = tmp_path / "step_2"  # a resume's checkpoint that recorded 4 at length 32 and 24 at 64
    checkpoint.mkdir()
    (checkpoint / "run.json").write_text(json.dumps(
        {"fingerprint": {"options": {"micro_batch_size": "4,24", "seq_lengths": [32, 64]}}}))
    got = _without_interpreter(f"""
        import json
        import torch
        import fastbert
        from fastbert.bench import memory_cases
        from fastbert.simulated.device_fit import RESERVE
        from fastbert.train.distributed import Dist
        from fastbert.train.options import PretrainConfig
        from fastbert.train.run import auto_micro_batches, plan_phases

        config = fastbert.BertConfig.tiny()
        cfg = PretrainConfig(model="tiny", batch_size=24, micro_batch_size="auto", seq_lengths="32,64",
                             phase_fractions="0.5,0.5")
        def peak(seqlen, batch):
            case = memory_cases.MemoryCase("pretrain", "tiny", seqlen, batch, "adamw", config=config)
            return memory_cases.plan(case, "fastbert", batch).peak_bytes
        free = RESERVE.needed(peak(32, 7))  # 7 sequences of 32 fit exactly
        sizes = {{}}
        for resume in (None, {str(checkpoint)!r}):
            phases = plan_phases(cfg, 128, 1)
            auto_micro_batches(cfg, config, phases, Dist(device=torch.device("cuda")), torch.bfloat16, resume, free)
            sizes[str(resume is not None)] = [p.micro_batch_size for p in phases]
        print(json.dumps({{"free": free, "sizes": sizes, "peak_32_8": peak(32, 8),
                          "peaks_64": {{d: peak(64, d) for d in (1, 2, 3, 4, 6, 8, 12, 24)}}}}))
    """)
    free = got["free"]
    assert not fits(got["peak_32_8"], free)
    fitting_64 = [int(d) for d, peak in got["peaks_64"].items() if fits(peak, free)]
    assert fitting_64 and max(fitting_64) < 6  # the longer phase gets fewer sequences
    assert got["sizes"]["False"] == [6, max(fitting_64)]  # 6: the largest divisor of 24 up to 7
    # a resume keeps the sizes its checkpoint's run recorded while they fit, and replaces those that do not
    assert got["sizes"]["True"] == [4, max(fitting_64)]


def test_gpu_check_runs_the_plans_step_and_picks_a_batch_that_fits():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_gpu_check", "benchmarks/memory_gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    case = memory_cases.MemoryCase("pretrain", "tiny", 32, 8, "lamb", providers=(memory_cases.HF_SDPA,),
                                   config=fastbert.BertConfig.tiny())
    peak_3 = memory_cases.plan(case, memory_cases.HF_SDPA, 3).peak_bytes
    assert check.batch_that_fits(case, memory_cases.HF_SDPA, device_fit.RESERVE.needed(peak_3)) == 3
    assert check.batch_that_fits(case, memory_cases.HF_SDPA, 80 * GiB) == 8  # the stated batch
    assert check.batch_that_fits(case, memory_cases.HF_SDPA, device_fit.RESERVE.fixed_bytes) == 0

    torch.manual_seed(0)
    step, model = check.make_step(case, memory_cases.HF_SDPA, 2, torch.device("cpu"))
    # the step holds the whole batch, as the plan does, the mask transformers is not given too
    held = [cell.cell_contents for cell in step.__closure__ if isinstance(cell.cell_contents, dict)]
    assert held and "attention_mask" in held[0]
    before = [p.detach().clone() for p in model.parameters()]
    step()  # a real step: the weights move and every gradient is cleared, as the plan's step does
    assert all(p.grad is None for p in model.parameters())
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) > len(before) // 2


def _row(case, provider, **figures):
    shape = {"mode": case.split("/")[0], "seqlen": int(re.search(r"S=(\d+)", case).group(1)),
             "optimizer": None if case.startswith("inference") else "adamw",
             "checkpointing": case.split("checkpointing=")[1] if "checkpointing=" in case else "none"}
    row = {"suite": "memory", "date": "2026-11-24T00:00:00+00:00", "device": memory_cases.PLANNED_DEVICE,
           "host": "a CPU", "torch": "2.13", "triton": "3.9", "transformers": "5", "commit": "abc", "dirty": False,
           "command": "fastbert bench --suite memory", "case": case, "provider": provider, "status": "ok",
           "shape": shape, "batch": 64, "tokens": 64 * shape["seqlen"], "peak_bytes": 40 * GiB,
           "forward_end_bytes": 30 * GiB, "saved_for_backward_bytes": 28 * GiB, "sbh_per_layer": 30.0,
           "largest_batch": 100, "reserve": device_fit.RESERVE.text(),
           "peak_breakdown": {"weights": GiB, "activations": 30 * GiB}, "saved_by_module_kind": {"bert.x": 10},
           "fsdp2_peak_bytes": {"2": 39 * GiB, "4": 38 * GiB, "8": 37 * GiB}}
    row.update(figures)
    return row


def test_perf_section_shows_ratios_goals_and_what_a_gpu_has_not_measured():
    base = "pretrain/base,S=512,adamw"
    rows = [_row(base, "fastbert", peak_bytes=16 * GiB, sbh_per_layer=19.5, largest_batch=260),
            _row(base, "hf-sdpa", peak_bytes=40 * GiB, largest_batch=100),
            _row(base, "hf-eager", peak_bytes=64 * GiB, largest_batch=50),
            _row(base + ",checkpointing=full", "fastbert", peak_bytes=8 * GiB, checkpointing_extra_flops=1e12,
                 checkpointing_extra_flops_fraction=0.25),
            _row("inference/base,S=512", "fastbert", peak_bytes=12 * GiB),
            _row("inference/base,S=512", "hf-sdpa", peak_bytes=10 * GiB)]
    text = "\n".join(memory_report.memory_section(rows))
    assert memory_report.TITLE in text and "A plan from the code, not a measurement on a GPU" in text
    assert "| BERT-base, adamw: encoder activations <= 20·s·b·h bytes per layer | 19.50·s·b·h | yes |" in text
    assert "| BERT-base, adamw: peak <= 0.45x hf-sdpa's at batch 64 | 0.40x | yes |" in text
    assert "| BERT-base, adamw: largest batch in 80 GB >= 2.5x hf-sdpa's | 2.60x | yes |" in text
    assert "| BERT-large, adamw: peak <= 0.6x hf-sdpa's at the same batch | not planned | - |" in text
    assert "largest 1.20x (inference/base,S=512 vs hf-sdpa) | no |" in text
    assert "| 0.40x | 0.25x | 2.60x |" in text  # fastbert / hf-sdpa, / hf-eager, largest batch / hf-sdpa
    assert "| pretrain/base,S=512,adamw | full | 8.00 |" in text and "1e+12 (25.0%)" in text
    assert "Not yet measured on a GPU" in text and "gpu_check.sh" in text

    measured = {**rows[0], "suite": "memory-gpu-check", "planned_peak_bytes": 16 * GiB, "peak_mem_bytes": 17 * GiB,
                "device": "NVIDIA H100 80GB HBM3", "cuda": "12.8"}
    text = "\n".join(memory_report.memory_section(rows + [measured]))
    assert "| pretrain/base,S=512,adamw | fastbert | 64 | 16.00 | 17.00 | 1.062 |" in text
    assert "Not yet measured on a GPU" not in text


def test_the_figure_beyond_issue_18s_list_is_split_only_when_its_parts_add_up():
    """BERT-base keeps 20 + 2/12 (the last output) + 48/768 (log-sum-exp) + 72/768 (LayerNorm statistics)
    bytes per token per layer; a figure its parts do not add up to is not explained away."""
    planned = 20 + 2 / 12 + 4 * 12 / 768 + 2 * 4 * 9 / 768
    row = {"provider": "fastbert", "sbh_per_layer": planned,
           "shape": {"size": "base", "mode": "pretrain", "checkpointing": "none"}}
    assert memory_report.beyond_the_list(row).startswith("base: 20.3229·s·b·h per layer = the 20 of")
    assert memory_report.beyond_the_list({**row, "sbh_per_layer": planned + 0.01}) is None
    assert memory_report.beyond_the_list({**row, "provider": "hf-sdpa"}) is None
