"""A dispatch mode that records the ops it sees, for tests that check which ops a call runs."""
from torch.utils._python_dispatch import TorchDispatchMode


class RecordingMode(TorchDispatchMode):
    """Records each op's name ("aten.add.Tensor", "fastbert.feed_forward.default") in `seen`. Being a dispatch
    mode, as fastbert's memory tracker is one, it sends a fused op through its custom op, seen as one op."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
