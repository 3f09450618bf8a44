"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's interpreter, which is chosen when a kernel is
defined: TRITON_INTERPRET must be set before any fastbert.kernels module is imported.
"""
import os

# numpy's OpenBLAS threads spin against each other (and pytest -n 2's other worker) on a small CPU
# machine, which made the interpreter's fp32 tl.dot ~1000x slower; set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# the tests hold "auto" to the committed table of paths (fastbert/paths.json), not one a GPU session's FASTBERT_PATHS
# names; fastbert.paths reads the variable at import
os.environ.pop("FASTBERT_PATHS", None)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import bounds_check  # noqa: E402  (after the variable: Triton reads it when it defines a kernel)

    bounds_check.install()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n N: N processes share the cores, which torch's intra-op threads default to in each; a thread
    # beyond a process's share only spins (see one_thread): test_dropout_switches.py took twice the CPU time
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def one_thread():
    """One intra-op torch thread: CI runs two test processes on two cores, and on small matmuls a
    second thread per process only spins (4x the CPU time of a tiny model's training step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU for speed or size (full-size cases, timings); "
                                       "every dtype, bf16 included, is tested in the interpreter at smaller sizes")
    config.addinivalue_line("markers", "slow(reason): the README's second test command's share, slow by nature "
                                       "(the compile gates, full-size cases, end-to-end runs, the cross products of "
                                       "dtypes, layouts and architectures); the first keeps each kernel and model "
                                       "path in fp32 and bf16")
    # fastbert talks through the `fastbert` logger; a warning attributed to one of its own lines (its own
    # warnings.warn, or a library's whose stacklevel points into fastbert) tells users nothing: a test error
    config.addinivalue_line("filterwarnings", "error:::fastbert")


def pytest_runtest_teardown(item, nextitem):
    """On a GPU, each test gives its cached blocks back: benchmarks/gpu_check.sh runs 12 test processes on one
    GPU, and blocks one process kept cached after its large cases made another's model tests run out of
    memory (the third H100 session: 54 of 665 tests failed, most out of memory; the model test files run again
    alone in 4 processes all passed)."""
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in item.iter_markers("slow"):
            if not mark.kwargs.get("reason"):
                raise pytest.UsageError(f"{item.nodeid}: a slow mark says why: pytest.mark.slow(reason=...)")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
