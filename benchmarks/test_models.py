"""Every whole-model case of the suite (training step, inference, capacity), one benchmark per provider."""
import pytest

from fastbert.bench import model_cases, runner
from fastbert.bench.runner import SUITE_TIMING
from fastbert.bench.timing import synchronized

SUITE = runner.default_suite()
ITEMS = [i for i in runner.work_items(SUITE) if isinstance(i.case, model_cases.ModelCase)]


@pytest.mark.parametrize("item", ITEMS, ids=[f"{i.case.name}-{i.provider}" for i in ITEMS])
def test_model(benchmark, item, device, peaks):
    benchmark.group = item.case.name
    if item.case.mode == "capacity":
        rows = model_cases.measure_model(item.case, item.provider, device, peaks)
        benchmark.extra_info["rows"] = rows
        benchmark.pedantic(lambda: None, rounds=1)  # the search is the figure; nothing to time
        return
    step, data = model_cases.prepare(item.case, item.provider, device)
    benchmark.extra_info["rows"] = [model_cases.measure_step(item.case, step, data, device, peaks,
                                                             SUITE_TIMING[SUITE])]
    benchmark.pedantic(synchronized(step, device), rounds=3 if SUITE == "smoke" else 10, warmup_rounds=1)
    del step, data
    runner.release(device, item.provider == model_cases.HF_COMPILE)
