"""fastbert's benchmark suite: the one place fastbert's performance figures come from.

- `provenance`: what every result row records about where and how it was measured.
- `timing`: medians after warm-up (CUDA events on a GPU) and peak memory (the allocator's own count).
- `peaks`: the device's measured copy bandwidth and matmul rate, the references every ratio is read against.
- `op_cases`, `model_cases`: what is measured, each provider side by side, and the FLOP and byte formulas.
- `runner`: the suites (`smoke`, `gpu`, `cpu-memory`), the progress bar and the JSON rows.
- `report`: PERF.md and its plots, generated from the committed JSON rows.
- `cli`: `fastbert bench`.
"""
