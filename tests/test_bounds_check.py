"""tests/bounds_check.py, which every interpreter run installs (conftest.py): a kernel that reads or writes past its
tensors' storage fails as a GPU would fault, and masked-off lanes may point anywhere."""
import pytest
import torch
import triton
import triton.language as tl

from fastbert.kernels.numerics import INTERPRETER

pytestmark = pytest.mark.skipif(not INTERPRETER, reason="checks Triton's interpreter (the CPU tests)")


@triton.jit
def _copy(SRC, DST, n, offset, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    if MASKED:
        keep = cols < n
        tl.store(DST + cols, tl.load(SRC + cols + offset, mask=keep, other=0.0), mask=keep)
    else:
        tl.store(DST + cols, tl.load(SRC + cols + offset))


def test_the_interpreter_fails_a_read_past_the_storage():
    src, dst = torch.zeros(8), torch.zeros(8)
    with pytest.raises(Exception, match="_copy: a load of 1 addresses outside every argument's storage"):
        _copy[(1,)](src, dst, 8, 1, BLOCK=8, MASKED=False)


def test_the_interpreter_fails_a_write_past_the_storage():
    src, dst = torch.zeros(16), torch.zeros(8)
    with pytest.raises(Exception, match="_copy: a store of 8 addresses outside every argument's storage"):
        _copy[(1,)](src, dst, 16, 0, BLOCK=16, MASKED=False)


def test_the_interpreter_passes_masked_lanes_and_views_inside_the_storage():
    src = torch.arange(16.0)
    dst = torch.zeros(16)
    _copy[(1,)](src, dst, 5, 0, BLOCK=16, MASKED=True)  # lanes 5..15 masked off
    assert dst[:5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    view = src[8:]  # a view reads inside its storage, past its own end
    _copy[(1,)](view[:4], dst, 8, 0, BLOCK=8, MASKED=False)
    assert dst[:8].tolist() == list(range(8, 16))
