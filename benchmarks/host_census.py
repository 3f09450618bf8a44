"""What the host does in one model call, counted rather than timed: fastbert against transformers.

Run from the repository root: `python benchmarks/host_census.py [--out DIR] [--size base|modernbert-base]`.
For each model row of `fastbert bench --suite host` (BERT-base and ModernBERT-base at the host suite's narrow
widths, a padded batch, Triton launches stubbed) and each provider (fastbert on its Triton path, on an H100's
path and on its PyTorch path, transformers with SDPA), one inference forward and one training step (forward,
backward, AdamW) are counted:
- autograd nodes of the step's graph: all, those implemented in Python (autograd.Function backwards, each a
  call from the engine into Python) and view nodes (views, reshapes, transposes, expands: each a C++ node run
  forward and back);
- kernel launches (calls of fastbert's launch, kernels/launch.py), in the forward and in the backward;
- Python function calls and calls from Python into C (PyTorch's bindings, builtins), as sys.setprofile sees
  them: the interpreter's share of the host time, which a CPU timing on a shared machine buries in noise;
- host syncs (fastbert.host_syncs' dispatch-level counter).
The counts are exact: the same code, library versions and inputs give the same figures on any machine.
Prints a table and writes the rows (with provenance) to DIR/host-census-<machine>-<time>.json.
"""
from __future__ import annotations

import collections
import sys

import torch

from fastbert import ops
from fastbert.bench import host_suite
from fastbert.bench.runner import cpu_script_parser, save_cpu_rows
from fastbert.command import run_command
from fastbert.kernels import launch as kernel_launch
from fastbert.host_syncs import HostSyncCounter
from fastbert.simulated.host_time import one_thread, stubbed_launches

PROVIDERS = host_suite.MODEL_PROVIDERS
# every kernel launch is a call of fastbert's launch: kernels/launch.c's (a C call), or its Python path's
_LAUNCH = kernel_launch.launch
_LAUNCH_CODE = getattr(_LAUNCH, "__code__", None)
SIZES = ("base", "modernbert-base")


class _CallCounter:
    """sys.setprofile's events while entered: Python calls, C calls, kernel launches (calls of fastbert's launch)."""

    def __init__(self):
        self.counts = collections.Counter(python_calls=0, c_calls=0, launches=0)

    def _profile(self, frame, event, arg):
        if event == "call":
            self.counts["python_calls"] += 1
            self.counts["launches"] += frame.f_code is _LAUNCH_CODE
        elif event == "c_call":
            self.counts["c_calls"] += 1
            self.counts["launches"] += arg is _LAUNCH

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def graph_nodes(loss: torch.Tensor) -> dict:
    """Autograd nodes reachable from loss.grad_fn (parameter accumulators left out): all, Python, view."""
    seen, stack = set(), [loss.grad_fn]
    counts = collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue
        counts["autograd_nodes"] += 1
        counts["python_nodes"] += isinstance(node, torch.autograd.function.BackwardCFunction)
        counts["view_nodes"] += name in ("ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
                                         "TBackward0", "PermuteBackward0", "ExpandBackward0")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return dict(counts)


def census(size: str, provider: str) -> list[dict]:
    """Two rows, "fwd" (an inference forward) and "fwd+bwd" (a training step), after warm-up calls."""
    # host syncs are counted in a call of their own: the counter is a dispatch mode, under which fastbert's
    # fused ops take their custom ops and every aten op a Python call
    model, inputs = host_suite.model_and_inputs(size, provider, "inference")
    ops.set_stubbed_auto(host_suite.auto_choices(size, provider, "inference"))

    def infer():
        with torch.no_grad():
            model(**inputs)
    infer()
    with HostSyncCounter() as syncs:
        infer()
    with _CallCounter() as forward:
        infer()
    rows = [{"direction": "fwd", **forward.counts, "host_syncs": syncs.syncs}]

    model, inputs = host_suite.model_and_inputs(size, provider, "train")
    ops.set_stubbed_auto(host_suite.auto_choices(size, provider, "train"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def finish(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finish(model(**inputs).loss)
    with HostSyncCounter() as syncs:
        finish(model(**inputs).loss)
    with _CallCounter() as forward:
        loss = model(**inputs).loss
    nodes = graph_nodes(loss)
    with _CallCounter() as backward:
        finish(loss)
    step = {key: forward.counts[key] + backward.counts[key] for key in ("python_calls", "c_calls", "launches")}
    rows.append({"direction": "fwd+bwd", **step, "backward_launches": backward.counts["launches"], **nodes,
                 "host_syncs": syncs.syncs})
    return [{"case": f"{size} (host suite widths)", "provider": provider, **row} for row in rows]


COLUMNS = ("python_calls", "c_calls", "launches", "backward_launches", "autograd_nodes", "python_nodes",
           "view_nodes", "host_syncs")


def table(rows: list[dict]) -> str:
    lines = [f"{'case':28s} {'provider':15s} {'dir':8s} " + " ".join(f"{c:>17s}" for c in COLUMNS)]
    for row in rows:
        lines.append(f"{row['case']:28s} {row['provider']:15s} {row['direction']:8s} "
                     + " ".join(f"{row.get(c, '-'):>17}" for c in COLUMNS))
    return "\n".join(lines)


def main() -> int:
    parser = cpu_script_parser(__doc__, SIZES)
    args = parser.parse_args()
    # an output that cannot be written is one message and exit code 2, as for the fastbert commands
    return run_command("host-census", lambda: _census_rows(args))


def _census_rows(args) -> None:
    rows = []
    with one_thread(), stubbed_launches():
        for size in args.size or SIZES:
            for provider in PROVIDERS:
                rows += census(size, provider)
    save_cpu_rows(args.out, "host-census",
                  "none: counted (sys.setprofile's calls, fastbert's launches, the autograd graph)", rows, table)


if __name__ == "__main__":
    sys.exit(main())
