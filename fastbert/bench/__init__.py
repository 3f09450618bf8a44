"""fastbert's benchmark suite: the one place fastbert's performance figures come from.

- `provenance`: what every result row records about where and how it was measured.
- `timing`: medians after warm-up (CUDA events on a GPU; for an op, also the GPU's time alone) and peak memory
  (the allocator's own count).
- `peaks`: the device's measured copy bandwidth and matmul rate, the references every ratio is read against.
- `op_cases`, `model_cases`: what is measured, each provider side by side, and the FLOP and byte formulas.
- `runner`: the suites (`smoke`, `gpu`, `cpu-memory`), the progress bar and the JSON rows.
- `report`: PERF.md and its plots, generated from the committed JSON rows.
- `cli`: `fastbert bench`.

The memory suite (`memory_cases`) and the compile audit (`compile_audit`) run on the simulated GPU of
fastbert.simulated (the stand-in driver, meta tensors, the memory tracker and the step's plan), which
`fastbert pretrain --micro-batch-size auto` shares.
"""
