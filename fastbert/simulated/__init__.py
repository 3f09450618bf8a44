"""The simulated GPU: fastbert's host code run as on a GPU, on a machine without one. It serves training
(`fastbert pretrain --micro-batch-size auto`) and the benchmarks (`fastbert bench`'s memory suite and compile
audit), below both: it imports nothing of fastbert.bench and, of fastbert.train, only the optimizers
(fastbert.train.optim), so that a planned step updates the weights as a training step does.

- `stand_in_gpu`: a stand-in Triton driver that reports an H100 or an A100 and records launches instead of
  running them.
- `meta_gpu`: meta tensors that stand for an H100's CUDA tensors (the stand-in driver, CUDA autocast emulated,
  SDPA as its flash backend).
- `memory_tracker`: an exact count of the bytes a piece of PyTorch code holds, per category.
- `memory_plan`: the memory of one training step or inference forward, planned on meta tensors.
- `pretraining`: the pretraining model and batch a plan runs.
- `device_fit`: a plan fitted onto a device: the reserve, the largest batch that fits, FSDP2's per-rank peak and
  `--micro-batch-size auto`'s choice.
"""
