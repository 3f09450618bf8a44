"""What a compiled kernel's binary says about its resources, read with the tools the Triton wheel ships
(triton/backends/nvidia/bin): registers and stack frame from `cuobjdump -res-usage`, the warpgroup MMA
(HGMMA, Hopper) and MMA (HMMA) instructions from `cuobjdump -sass`, and spilled bytes from `ptxas -v`
run on Triton's PTX exactly as Triton runs it.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import io
import os
import re
import subprocess
import tempfile


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton import knobs

    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, path], check=True, capture_output=True,
                              text=True).stdout
    finally:
        os.remove(path)


def registers(cubin: bytes) -> int:
    """Registers per thread of the cubin's one kernel (its resource usage alone: no disassembly)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage")).group(1))


def resources(cubin: bytes) -> dict:
    """{registers, stack_bytes, wgmma, mma} of the cubin's one kernel: registers per thread and stack frame
    bytes per thread (cuobjdump -res-usage; the stack holds what spills), and the counts of warpgroup MMA
    (HGMMA) and MMA (HMMA) instructions in its SASS (cuobjdump -sass)."""
    text = _cuobjdump(cubin, "-res-usage", "-sass")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line:\n{text[:2000]}")
    opcodes = collections.Counter()  # without modifiers: HGMMA.64x128x16.F32.BF16 counts as HGMMA
    for mnemonic, count in mnemonics(text).items():
        opcodes[mnemonic.split(".")[0]] += count
    return {"registers": int(usage.group(1)), "stack_bytes": int(usage.group(2)),
            "wgmma": opcodes["HGMMA"], "mma": opcodes["HMMA"]}


def sass(cubin: bytes) -> str:
    """The cubin's SASS (cuobjdump -sass)."""
    return _cuobjdump(cubin, "-sass")


_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/", re.MULTILINE)
# an instruction line's mnemonic with its modifiers (IMAD.WIDE.U32), after an optional predicate (@P0, @!UPT)
_MNEMONIC = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)
_BACK_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")


def mnemonics(sass_text: str) -> collections.Counter:
    """How many times each instruction (mnemonic with modifiers) appears in a kernel's SASS."""
    return collections.Counter(_MNEMONIC.findall(sass_text))


def barriers_in_loops(sass_text: str) -> list[int]:
    """The barriers (BAR.SYNC) inside each loop of a kernel's SASS, one count per loop in address order: a loop is
    a branch to a lower address, its body the instructions from that target to the branch. A barrier in a loop
    that streams rows makes every warp wait for the slowest once per iteration."""
    instructions = [(int(m.group(1), 16), line) for line in sass_text.splitlines() for m in [_ADDRESS.match(line)] if m]
    loops = [(int(target.group(1), 16), address) for address, line in instructions
             for target in [_BACK_BRANCH.search(line)] if target and int(target.group(1), 16) < address]
    return [sum(1 for address, line in instructions if start <= address <= end and "BAR.SYNC" in line)
            for start, end in sorted(loops)]


def ptxas_spills(ptx: str, metadata: dict, capability: int) -> dict:
    """{spill_store_bytes, spill_load_bytes} per thread from `ptxas -v`, run by Triton's own make_cubin
    (the flags Triton compiles with) with its log printed, on the kernel's PTX."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", capability, 32))
    options = backend.parse_options({k: v for k, v in metadata.items() if k != "target"})
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        backend.make_cubin(ptx, {}, options, capability)
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    if found is None:
        raise RuntimeError(f"ptxas -v printed no spill figures:\n{log.getvalue()[:2000]}")
    return {"spill_store_bytes": int(found.group(1)), "spill_load_bytes": int(found.group(2))}


@functools.lru_cache(maxsize=None)
def ptxas_version(capability: int) -> str:
    """The release of the ptxas Triton uses for this capability, e.g. "12.8.93"."""
    from triton.backends.nvidia.compiler import get_ptxas

    text = subprocess.run([get_ptxas(capability).path, "--version"], check=True, capture_output=True,
                          text=True).stdout
    found = re.search(r"V(\d+\.\d+\.\d+)", text)
    return found.group(1) if found else text.strip().splitlines()[-1]
