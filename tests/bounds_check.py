"""Under Triton's interpreter, every load and store a kernel makes (its unmasked lanes) must fall inside the storage of
one of its tensor arguments; anything else fails the test with the kernel's name and the addresses.

Why: on a GPU an address outside every allocation is an illegal memory access, a sticky CUDA error that fails every
later test of the process (the first H100 run lost whole test files that way); the interpreter's numpy reads such an
address without complaint, or reads a neighbour's memory. This makes the CPU tests fail where the GPU would fault.
Installed by tests/conftest.py when the interpreter runs the kernels; it wraps Triton's interpreter (3.6-3.9 names),
not fastbert's code.
"""
import numpy as np
import triton.runtime.interpreter as interpreter

_ARGUMENT_STORAGES: list = []  # (kernel name, [(first byte, one past the last)]) of each kernel being run


def _storages(arguments) -> list[tuple[int, int]]:
    spans = []
    for a in arguments:
        if hasattr(a, "untyped_storage"):
            storage = a.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return spans


def _check(kind: str, pointers, mask) -> None:
    if not _ARGUMENT_STORAGES:
        return
    name, spans = _ARGUMENT_STORAGES[-1]
    addresses = pointers.data.astype(np.uint64)
    live = np.broadcast_to(mask.data, addresses.shape).astype(bool)
    if not live.any():
        return
    size = np.dtype(interpreter._get_np_dtype(pointers.get_element_ty())).itemsize
    touched = addresses[live]
    inside = np.zeros(touched.shape, dtype=bool)
    for first, end in spans:
        inside |= (touched >= first) & (touched + size <= end)
    if not inside.all():
        outside = touched[~inside]
        raise AssertionError(f"{name}: a {kind} of {outside.size} addresses outside every argument's storage "
                             f"(e.g. {int(outside[0]):#x}; storages {[(hex(a), b - a) for a, b in spans]}): "
                             f"an illegal memory access on a GPU")


def install() -> None:
    executor = interpreter.GridExecutor
    builder = type(interpreter.interpreter_builder)
    bind, run = executor._init_args_hst, executor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def bind_checked(self, args_dev, kwargs):
        args_host, kwargs_host = bind(self, args_dev, kwargs)
        _ARGUMENT_STORAGES.append((self.fn.__name__, _storages([*args_host, *kwargs_host.values()])))
        return args_host, kwargs_host

    def run_checked(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        finally:
            if _ARGUMENT_STORAGES:
                _ARGUMENT_STORAGES.pop()

    def load_checked(self, pointers, mask, other, cache_policy, is_volatile):
        _check("load", pointers, mask)
        return load(self, pointers, mask, other, cache_policy, is_volatile)

    def store_checked(self, pointers, value, mask, cache_policy):
        _check("store", pointers, mask)
        return store(self, pointers, value, mask, cache_policy)

    executor._init_args_hst, executor.__call__ = bind_checked, run_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
