"""Training faults from issue #14, each with what fastbert does about it (docs/reliability.md lists them):
checkpoints a new run cannot destroy, resumes that refuse a changed run, metrics that survive a crash,
non-finite runs that point at a good checkpoint. Small models on CPU."""
import os

import pytest
import torch

from fastbert import BertForPreTraining
from fastbert.train import pretrain
from tests.test_pretrain import SMALL, config, data, losses  # noqa: F401  (data: the module's dataset fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def checkpoint_steps(out):
    return sorted(int(name.split("_")[1]) for name in os.listdir(os.path.join(out, "checkpoints"))
                  if name.startswith("step_"))


def test_first_metrics_line_after_a_resume_averages_the_uninterrupted_runs_steps(data, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    pretrain.train(config(data, whole, log_every=2), SMALL)
    pretrain.train(config(data, parts, log_every=2, stop_at=3), SMALL)  # stops between two metrics lines
    pretrain.train(config(data, parts, log_every=2), SMALL)
    assert [r["step"] for r in losses(parts)] == [2, 4, 6]
    assert losses(parts) == losses(whole)  # step 4's line averages steps 3 and 4, not 4 alone


def test_non_finite_stop_names_the_checkpoint_before_the_bad_steps_and_saves_none_during_them(
        data, tmp_path, monkeypatch):
    forward = BertForPreTraining.forward

    def diverging_forward(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        diverging_forward.calls = getattr(diverging_forward, "calls", 0) + 1
        if diverging_forward.calls >= 3:  # from step 3 on
            output.mlm_loss = output.mlm_loss * float("nan")
        return output

    monkeypatch.setattr(BertForPreTraining, "forward", diverging_forward)
    with pytest.raises(pretrain.TrainingError) as error:
        pretrain.train(config(data, tmp_path, save_every=1, keep_checkpoints=10, max_bad_steps=3), SMALL)
    assert "steps 3 to 5" in str(error.value)
    assert f"{os.path.join(tmp_path, 'checkpoints', 'step_00000002')};" in str(error.value)
    assert checkpoint_steps(tmp_path) == [1, 2]
