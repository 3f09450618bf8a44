"""Triton kernels, one file per fused op, installed as `fastbert.kernels`.

Each file holds the @triton.jit forward and backward kernels, their host launchers and a thin
autograd wrapper. This package imports only torch and triton; `fastbert.ops` chooses when to use it.
"""
