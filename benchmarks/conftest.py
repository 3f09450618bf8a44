"""pytest-benchmark suites over fastbert.bench's cases: `pytest benchmarks/`.

On a CUDA machine the items are the GPU suite's; elsewhere the smoke suite's. pytest-benchmark
times each item's forward + backward (or whole step) with a host clock that synchronizes the GPU
after every call; the CUDA-event rows that `fastbert bench` writes for the same item go into the
benchmark's extra_info, so `--benchmark-json` carries both.
"""
import pytest
import torch

from fastbert.bench import runner
from fastbert.bench.peaks import measure_peaks, peak_figures
from fastbert.bench.provenance import provenance

SUITE = runner.default_suite()


@pytest.fixture(scope="session")
def device():
    return runner.suite_device(SUITE)


@pytest.fixture(scope="session")
def peaks(device):
    return peak_figures(measure_peaks(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                      quick=SUITE == "smoke"))


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastbert"] = provenance(runner.suite_device(SUITE))
