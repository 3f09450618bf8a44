"""kernels/launch.py's cached launch path picks exactly the kernel Triton's own launch would.

The cache is what makes a fused op's launch cost the host what a PyTorch op costs; a wrong key would launch
a kernel specialised for other arguments (an aligned pointer where the tensor is not, an int taken as 1 or as
a multiple of 16, a 32-bit int that is 64-bit). Checked with the stand-in driver in stub mode
(fastbert.simulated.host_time.stubbed_launches): Triton's kernel cache then holds one stub per
specialisation, so the kernel object a launch returns names the specialisation it launched. Compiled-kernel
launchers are needed (under TRITON_INTERPRET launch() is Triton's own launch), so the check runs in a process
of its own without it, once for each implementation of the cached path (kernels/launch.c's and the Python one).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from fastbert.kernels.launch import _build_tools_missing, as_rows, row_strides

_LAUNCHES = """
import json
import torch
from fastbert.kernels import launch as launch_module
from fastbert.kernels import layer_norm, matmul
from fastbert.kernels.launch import cdiv, launch
from fastbert.simulated.host_time import stubbed_launches

through_triton = []
first = launch_module.KernelLauncher._first
def counting_first(self, *args):
    through_triton.append(self.kernel)
    return first(self, *args)
launch_module.KernelLauncher._first = counting_first
through_python = []  # launches that reached KernelLauncher (the C launch's own cache did not serve them)
python_call = launch_module.KernelLauncher.__call__
def counting_call(self, *args):
    through_python.append(self.kernel)
    return python_call(self, *args)
launch_module.KernelLauncher.__call__ = counting_call

ROWS, HIDDEN, OUT = 16, 64, 48

def rows_of(columns, misaligned):
    # [ROWS, columns] fp32; misaligned: its storage offset by one element (4 bytes, not a multiple of 16)
    flat = torch.zeros(ROWS * columns + 1)
    return (flat[1:] if misaligned else flat[:-1]).view(ROWS, columns)

def layer_norm_call(rows, misaligned, residual=None):
    # the inference launch: None for the pointers its flags leave unread (the residual, summed, stats, seed)
    x, y = rows_of(HIDDEN, misaligned), torch.empty(ROWS, HIDDEN)
    weight = torch.ones(HIDDEN)
    args = (x, residual, weight, weight, y, None, None, None, HIDDEN, 1, HIDDEN, 1, rows, HIDDEN, 1e-12, 0.0, 1.0,
            0.25)
    constexprs = dict(HAS_RESIDUAL=False, HAS_DROPOUT=False, HAS_BIAS=True, STORE_SUM=False, STORE_STATS=False,
                      SAVE_SIDE=False, SIDE_COLUMNS=8, BLOCK_ROWS=16, BLOCK_H=HIDDEN, num_warps=4)
    return layer_norm._layer_norm_fwd_kernel, (cdiv(rows, 16),), args, constexprs

def matmul_call(rows, misaligned):
    x, weight, out = rows_of(HIDDEN, misaligned), torch.ones(OUT, HIDDEN), torch.empty(ROWS, OUT)
    args = (x, weight, weight[:, 0].contiguous(), out, out, rows, OUT, HIDDEN, *x.stride(), *weight.stride(),
            rows, 1, 0, OUT, 0, 0, 1)
    constexprs = dict(HEAD_DIM=1, SPLIT_HEADS=False, ACTIVATION="none", STORE_PRE=False, HAS_BIAS=True,
                      GATED=False, INPUT_PRECISION="ieee")
    grid = lambda meta: (cdiv(rows, meta["BLOCK_M"]) * cdiv(OUT, meta["BLOCK_N"]),)
    return matmul._matmul_fwd_kernel, grid, args, constexprs

# what each launch hands the C launch of Triton's launcher object, as a GPU launch does (a kept entry directly,
# kernels/launch.py's _direct_launch): grid x, y, z, the stream, the launcher's head, then the kernel's arguments and
# tail, in one tuple (Triton 3.9) or one by one after a head of 9 (3.6)
from fastbert.simulated import stand_in_gpu
launcher_calls = []
stand_in_gpu._STUB_RUN.launch = lambda *args: launcher_calls.append(args)
def kernel_arguments(call):
    return call[-1] if type(call[-1]) is tuple else call[4 + 9:]
learnt = []  # the launch layouts _direct_launch learns (once per kept entry)
direct_launch = launch_module._direct_launch
launch_module._direct_launch = lambda *args: learnt.append(1) or direct_launch(*args)

def as_launcher_gets(args):
    # a kept launch hands a plain tensor (Tensor, Parameter) over as its address, anything else as itself
    return [a.data_ptr() if type(a) in (torch.Tensor, torch.nn.Parameter) else a for a in args]

def handed_over(args):
    # what the last launch handed the launcher in the arguments' places, compared by value for ints and None,
    # by identity for the rest
    got = kernel_arguments(launcher_calls[-1])[:len(args)]
    want = as_launcher_gets(args)
    return all(g is w or (type(g) is int and type(w) is int and g == w) for g, w in zip(got, want))

results = []
with stubbed_launches():
    for name, call in (("layer_norm", layer_norm_call), ("matmul", matmul_call)):
        # ints taken as 1, as multiples of 16, as other 32-bit ints and as 64-bit ints; 33 after 17 shares its
        # specialisation (the second level of the cache); each with an aligned and a misaligned tensor
        for rows in (1, 16, 17, 33, 2**31 + 5):
            for misaligned in (False, True):
                kernel, grid, args, constexprs = call(rows, misaligned)
                through_triton.clear()
                # a new specialisation: Triton's own launch makes its stub (the autotuner's benchmark makes the
                # candidates'), then takes it; from then on the cached path launches it
                first_launches = [launch(kernel, grid, *args, **constexprs) for _ in range(2)]
                first_through_triton = len(through_triton)
                through_triton.clear()
                through_python.clear()
                launched = launch(kernel, grid, *args, **constexprs)
                then_through_python = len(through_python)
                addresses = handed_over(args)
                # Triton's own choice, without launching: for the autotuned matmul the autotuner's run, which
                # calls the JITFunction's run with the config it chose for these arguments
                triton_own = kernel.run(*args, grid=grid, warmup=True, **constexprs)
                results.append({"case": f"{name}, rows={rows}, misaligned={misaligned}",
                                "same": launched is triton_own and triton_own is not None,
                                "first_through_triton": first_through_triton,
                                "then_through_triton": len(through_triton), "then_through_python": then_through_python,
                                "addresses": addresses, "distinct": id(triton_own)})
    # a tensor where the same launch passed None: a kernel of its own (Triton makes None a constant)
    kernel, grid, args, constexprs = layer_norm_call(16, False, residual=torch.zeros(ROWS, HIDDEN))
    for _ in range(3):
        launched = launch(kernel, grid, *args, **constexprs)
    triton_own = kernel.run(*args, grid=grid, warmup=True, **constexprs)
    none_row = next(row for row in results if row["case"] == "layer_norm, rows=16, misaligned=False")
    results.append({"case": "layer_norm, a tensor for None", "same": launched is triton_own and triton_own is not None,
                    "distinct_from_none": id(triton_own) != none_row["distinct"]})
    # a launch hook (a profiler's) installed: the launch goes through Triton, which calls it; removed: cached again
    import triton
    kernel, grid, args, constexprs = layer_norm_call(16, False)
    hook = lambda *args, **kwargs: None
    counts = []
    for install in (True, False):
        if install:
            triton.knobs.runtime.launch_enter_hook.add(hook)
        through_triton.clear()
        learnt.clear()
        launch(kernel, grid, *args, **constexprs)
        counts.append((len(through_triton), len(learnt)))
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    results.append({"case": "launch hook", "hooked_through_triton": counts[0][0],
                    "unhooked_through_triton": counts[1][0], "learnt_again": counts[0][1] + counts[1][1]})
    # an int subclass (an IntEnum's kind) for the row count: Triton specialises it by value, as an int
    class Count(int):
        pass
    for value in (1, 17):
        kernel, grid, args, constexprs = layer_norm_call(value, False)
        args = args[:12] + (Count(value),) + args[13:]  # the row count's place
        for _ in range(3):
            launched = launch(kernel, grid, *args, **constexprs)
        triton_own = kernel.run(*args, grid=grid, warmup=True, **constexprs)
        results.append({"case": f"int subclass {value}", "same": launched is triton_own and triton_own is not None})
    # a Parameter goes over as its address; a tensor subclass (which may have a data_ptr of its own) as itself
    class Addressed(torch.Tensor):
        pass
    kernel, grid, args, constexprs = layer_norm_call(16, False)
    args = (args[0].as_subclass(Addressed), args[1], torch.nn.Parameter(args[2]), *args[3:])
    for _ in range(3):
        launch(kernel, grid, *args, **constexprs)
    got = kernel_arguments(launcher_calls[-1])[:3]
    results.append({"case": "tensor types", "subclass_as_itself": got[0] is args[0],
                    "parameter_as_address": type(got[2]) is int and got[2] == args[2].data_ptr()})
    # the C launch's recent-call cache (kernels/launch.c): two kernels' calls taking turns are both served from it;
    # a call that differs from a kept one by one int, or by a constexpr equal to the kept one's but another object,
    # still launches Triton's own choice; clear() empties it
    recent = {}
    if launch_module._C_LAUNCH is not None:
        calls = [layer_norm_call(16, False), matmul_call(16, False)]
        for _ in range(3):
            for kernel, grid, args, constexprs in calls:
                launch(kernel, grid, *args, **constexprs)
        _, hits, misses = launch_module._C_LAUNCH.recent()
        served = [launch(kernel, grid, *args, **constexprs) for kernel, grid, args, constexprs in calls]
        _, hits_after, misses_after = launch_module._C_LAUNCH.recent()
        recent["turns_served"] = (hits_after - hits, misses_after - misses)
        recent["turns_same"] = all(kernel_launched is kernel.run(*args, grid=grid, warmup=True, **constexprs)
                                   for kernel_launched, (kernel, grid, args, constexprs) in zip(served, calls))
        kernel, grid, args, constexprs = layer_norm_call(17, False)  # rows=16's call but for one int
        launched = launch(kernel, grid, *args, **constexprs)
        recent["one_int_same"] = launched is kernel.run(*args, grid=grid, warmup=True, **constexprs)
        kernel, grid, args, constexprs = matmul_call(16, False)
        constexprs["INPUT_PRECISION"] = "".join(["ie", "ee"])  # equal to the kept "ieee", another object
        _, hits, misses = launch_module._C_LAUNCH.recent()
        launched = launch(kernel, grid, *args, **constexprs)
        _, hits_after, misses_after = launch_module._C_LAUNCH.recent()
        recent["equal_constexpr"] = (hits_after - hits, misses_after - misses)
        recent["equal_constexpr_same"] = launched is kernel.run(*args, grid=grid, warmup=True, **constexprs)
        # what tells calls apart in it: a tensor's dtype, a constexpr's value, its name (the same values in order,
        # HAS_RESIDUAL's and HAS_BIAS's names swapped), a bool for an int, None for a float; each such call, taking
        # turns with the kept one, launches Triton's own choice
        kernel, grid, args, constexprs = layer_norm_call(16, False)
        names = list(constexprs)
        residual_at, bias_at = names.index("HAS_RESIDUAL"), names.index("HAS_BIAS")
        names[residual_at], names[bias_at] = names[bias_at], names[residual_at]
        variants = {"dtype": (tuple(a.half() if isinstance(a, torch.Tensor) else a for a in args), constexprs),
                    "constexpr": (args, dict(constexprs, num_warps=8)),
                    "constexpr names": (args, dict(zip(names, constexprs.values()))),
                    "bool for int": (args[:9] + (True,) + args[10:], constexprs),
                    "None for float": (args[:15] + (None,) + args[16:], constexprs)}
        recent["variants_same"] = {}
        for name, (variant_args, variant_constexprs) in variants.items():
            for _ in range(3):
                launch(kernel, grid, *args, **constexprs)
                launched = launch(kernel, grid, *variant_args, **variant_constexprs)
            recent["variants_same"][name] = launched is kernel.run(*variant_args, grid=grid, warmup=True,
                                                                   **variant_constexprs)
        recent["held_before_clear"] = launch_module._C_LAUNCH.recent()[0]
        launch_module.clear_cache()
        recent["held_after_clear"] = launch_module._C_LAUNCH.recent()[0]
print(json.dumps({"c_launch": launch_module._C_LAUNCH is not None, "results": results, "recent": recent}))
"""


@pytest.mark.parametrize("path", ["c", "python"])
def test_the_cached_path_launches_the_kernel_triton_would(path):
    """Both implementations of the cached path: kernels/launch.c's (built where a C compiler and Python's headers
    are found) and the Python one it stands in for (FASTBERT_PYTHON_LAUNCH=1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTBERT_PYTHON_LAUNCH")}
    if path == "python":
        env["FASTBERT_PYTHON_LAUNCH"] = "1"
    elif _build_tools_missing():
        pytest.skip(f"the C launch cannot be built here: {_build_tools_missing()}")
    result = subprocess.run([sys.executable, "-c", _LAUNCHES], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["c_launch"] == (path == "c")
    *rows, tensor_for_none, hooked, int_subclass_1, int_subclass_17, tensor_types = report["results"]
    # a kept launch hands Triton's launcher each plain tensor's address (no data_ptr call or driver query of its
    # own per tensor on a GPU), a tensor subclass as itself
    assert tensor_types["subclass_as_itself"] and tensor_types["parameter_as_address"], tensor_types
    assert int_subclass_1["same"] and int_subclass_17["same"], (int_subclass_1, int_subclass_17)
    assert tensor_for_none["same"] and tensor_for_none["distinct_from_none"], tensor_for_none
    # under a hook the kept entry serves again once unhooked, its launch layout not learnt again
    assert (hooked["hooked_through_triton"], hooked["unhooked_through_triton"], hooked["learnt_again"]) == (1, 0, 0), \
        hooked
    for row in rows:
        assert row["same"], row["case"]
        assert row["then_through_triton"] == 0, row
        assert row["addresses"], row
        # the C launch serves a call it has seen from its own cache; the Python path is that cache itself
        assert row["then_through_python"] == (path == "python"), row
        # rows=33 reuses rows=17's specialisation: never through Triton
        assert (row["first_through_triton"] == 0) == (", rows=33," in row["case"]), row
    if path == "c":
        recent = report["recent"]
        assert recent["turns_served"] == [2, 0] and recent["turns_same"], recent
        assert recent["one_int_same"] and recent["equal_constexpr_same"], recent
        # compared by address, an equal constexpr of another object is not the kept call's: `kept` serves it
        assert recent["equal_constexpr"] == [0, 1], recent
        assert all(recent["variants_same"].values()), recent
        assert recent["held_before_clear"] > 0 and recent["held_after_clear"] == 0, recent
    # the stubs are distinct per specialisation: alignment and each int class name a kernel of their own
    for kernel in ("layer_norm", "matmul"):
        ids = {row["case"].split(", ", 1)[1]: row["distinct"] for row in rows if row["case"].startswith(kernel)}
        assert ids["rows=33, misaligned=False"] == ids["rows=17, misaligned=False"]
        assert len({ids[f"rows={r}, misaligned={m}"] for r in (1, 16, 17, 2**31 + 5) for m in (False, True)}) == 8


def test_row_strides_are_those_of_the_rows_view_where_one_exists():
    """launch.row_strides gives the strides as_rows' [rows, N] view of t has, without the view, for 2-D tensors and
    3-D ones whose leading dimensions merge (size-1 dimensions, a batch of one, sliced columns); None where as_rows
    has to copy (the leading dimensions do not merge), and beyond 3-D."""
    base = torch.zeros(4, 6, 10)
    merging = {"contiguous": base, "columns sliced": base[:, :, 2:7], "column stride 2": base[:, :, ::2],
               "one row a batch": base[:, :1], "batch of one": base[:1, 1:5], "one row": base[2:3, 3:4],
               "2-D": base[0], "2-D transposed": base[0].t(), "no rows": base[:0]}
    for name, t in merging.items():
        rows = as_rows(t)
        assert rows.data_ptr() == t.data_ptr() or t.numel() == 0, name
        if rows.shape[0] > 1:  # one row: any row stride reads it
            assert row_strides(t) == rows.stride(), name
        else:
            assert row_strides(t) is not None and row_strides(t)[1] == rows.stride()[1], name
    copied = {"sequence positions sliced": base[:, 1:5], "batch and positions swapped": base.transpose(0, 1)}
    for name, t in copied.items():
        assert row_strides(t) is None, name
        assert as_rows(t).data_ptr() != t.data_ptr(), name  # as_rows copies these rows: no view reads them
    assert row_strides(base.view(2, 2, 6, 10)) is None  # beyond 3-D: as_rows' view


_STEADY_MODELS = """
import json
from fastbert.bench import host_suite
from fastbert.kernels import launch
from fastbert.simulated.host_time import stubbed_launches

served = {}
with stubbed_launches():
    for size in ("base", "modernbert-base"):
        for provider in (host_suite.FASTBERT, host_suite.H100_AUTO):
            for direction in ("fwd", "fwd+bwd"):
                call = host_suite._model_calls(size, provider)(direction)
                for _ in range(3):
                    call()
                _, hits, misses = launch._C_LAUNCH.recent()
                call()
                _, hits_after, misses_after = launch._C_LAUNCH.recent()
                served[f"{size} {provider} {direction}"] = [hits_after - hits, misses_after - misses]
print(json.dumps(served))
"""


def test_the_recent_call_cache_serves_every_launch_of_a_steady_model():
    """kernels/launch.c's recent-call cache serves every launch of a model's repeated inference forward and training
    step (the host suite's calls: BERT-base and ModernBERT-base, as "triton" and as "auto" runs them on an H100). A
    launcher that passed a new object as a constexpr at each call (a float, a string built per call) would miss it at
    every launch, and pay for the key besides."""
    if _build_tools_missing():
        pytest.skip(f"the C launch cannot be built here: {_build_tools_missing()}")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTBERT_PYTHON_LAUNCH")}
    result = subprocess.run([sys.executable, "-c", _STEADY_MODELS], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.splitlines()[-1])
    assert len(served) == 8
    for call, (hits, misses) in served.items():
        assert hits > 0 and misses == 0, (call, hits, misses)
