"""Every op case of the suite, one benchmark per (case, provider), grouped by case."""
import pytest

from fastbert.bench import op_cases, runner
from fastbert.bench.runner import SUITE_TIMING
from fastbert.bench.timing import synchronized

SUITE = runner.default_suite()
ITEMS = [i for i in runner.work_items(SUITE) if isinstance(i.case, op_cases.OpCase)]


@pytest.mark.parametrize("item", ITEMS, ids=[f"{i.case.name}-{i.provider}" for i in ITEMS])
def test_op(benchmark, item, device, peaks):
    benchmark.group = item.case.name
    timing = SUITE_TIMING[SUITE]
    rows = runner.measure_op(item.case, item.provider, device, peaks, op_cases.DIRECTIONS, timing)
    benchmark.extra_info["rows"] = rows
    make_run, leaves = runner.op_runs(item.case, item.provider, device)
    run = synchronized(make_run("fwd+bwd"), device)

    def clear_grads():
        for t in leaves:
            t.grad = None

    benchmark.pedantic(run, setup=clear_grads, rounds=3 if SUITE == "smoke" else 20, warmup_rounds=1)
    runner.release(device, item.provider == op_cases.COMPILE)
