"""The device's measured peaks, taken in the same run as the figures read against them:
copy bandwidth (GB/s, for memory-bound ops) and the matmul rate (TFLOP/s, for MFU and matmul-bound
ops), in the dtype the suite runs (bf16 on a GPU, fp32 on a CPU)."""
from __future__ import annotations

import torch

from fastbert.bench.timing import time_ms


def measure_peaks(device: torch.device, dtype: torch.dtype, quick: bool = False) -> list[dict]:
    """Rows for op "peak": case "peak/copy" (gbps) and case "peak/matmul" (tflops, the best of a few
    square sizes). quick: small sizes, for the smoke run."""
    if device.type == "cuda":
        copy_bytes, sizes = (1 << 28, (4096,)) if quick else (1 << 30, (4096, 8192, 16384))
    else:
        copy_bytes, sizes = (1 << 24, (256,)) if quick else (1 << 28, (1024, 2048))
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device)
    rows = [{
        "op": "peak", "case": "peak/copy", "provider": "torch", "direction": "copy",
        "shape": {"bytes": copy_bytes}, "dtype": "float32", **copy_ms,
        "bytes": 2 * copy_bytes,  # read once, written once
        "gbps": 2 * copy_bytes / (copy_ms["median_ms"] * 1e-3) / 1e9,
    }]
    del src, dst
    best = None
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        timing = time_ms(lambda: a @ b, device)
        tflops = 2 * n ** 3 / (timing["median_ms"] * 1e-3) / 1e12
        if best is None or tflops > best["tflops"]:
            best = {"op": "peak", "case": "peak/matmul", "provider": "torch", "direction": "matmul",
                    "shape": {"m": n, "n": n, "k": n}, "dtype": str(dtype).removeprefix("torch."),
                    **timing, "flops": 2 * n ** 3, "tflops": tflops}
        del a, b
    return rows + [best]


def peak_figures(rows: list[dict]) -> dict[str, float]:
    """{"gbps": copy bandwidth, "tflops": matmul rate} from measure_peaks' rows."""
    by_case = {r["case"]: r for r in rows}
    return {"gbps": by_case["peak/copy"]["gbps"], "tflops": by_case["peak/matmul"]["tflops"]}
