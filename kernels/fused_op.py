# How a fused op is called: a torch.library custom op where PyTorch traces (torch.compile, torch.export, fake
# tensors, dispatch modes such as the memory tracker), and its host function directly in eager mode.
#
# Why both. A custom op is what lets torch.compile and torch.export see a Triton launcher as one node (its fake
# registration gives the output shapes). In eager mode it is pure cost: every call goes through the dispatcher's
# Python custom-op machinery (schema checks, argument normalisation, alias checks, an autograd.Function built
# on the fly, a redispatch), which the first H100 run measured at 300-450 us of host time per fused op call with
# Triton's own launch. In eager mode the same host function therefore runs directly, inside a plain
# torch.autograd.Function whose setup_context and backward are the custom op's own registrations: one
# implementation, two entrances, the same results (tests/test_fused_op.py checks both give equal outputs and
# gradients, and that torch.compile(fullgraph=True) still traces the op). `fastbert bench --suite host`
# measures what each entrance costs: its "fastbert-custom-op" rows run every op through the custom op.
#
# A third entrance, for torch.func.grad and jvp and for forward-mode AD: a new-style autograd.Function around
# the custom op (`differentiable_function`). torch.func refuses the custom op's own autograd (an old-style
# Function, pytorch/pytorch#170834), and jvp through the custom op or the host function would leave the
# tangents out (zero, no error); this Function gives torch.func.grad the registered backward, and refuses a
# tangent with an error naming the op (tests/test_torch_func.py). No entrance's backward is differentiable (the
# backward kernels are not): `once_differentiable` makes a second derivative through one an error naming the op,
# where it came out wrong.
import contextlib
import inspect
from typing import Callable, Optional

import torch
import torch.autograd.forward_ad as _FORWARD_AD

# Tensor types the eager path takes; any other subclass (FakeTensor, FunctionalTensor, DTensor, ...) belongs to
# a tracer or a wrapper that only the custom op's registrations know how to handle.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_AUTOGRAD_APPLY = torch._C._FunctionBase.__dict__["apply"]  # autograd.Function's C apply (a classmethod)


# looked up once: tracing runs on every fused op call (torch.compile still recognises is_compiling by identity)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_innermost_transform = torch._C._functorch.peek_interpreter_stack
# the torch.func transforms that differentiate: an op under them runs as a new-style autograd.Function
_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def tracing() -> bool:
    """Whether PyTorch traces or transforms the call: torch.compile / torch.export, a dispatch mode (fake
    tensors, proxies, fastbert's memory tracker), or a functorch transform (vmap, grad), whose wrapped
    tensors look like plain ones."""
    return _is_compiling() or _dispatch_modes() > 0 or _functorch_transforms()


class FusedOp:
    """A fused op's host function, registered as the custom op `name` (a drop-in for the object that
    torch.library.custom_op returns: register_fake, register_autograd, and calls with the function's
    arguments) and called directly in eager mode. Calls pass arguments positionally; missing trailing
    arguments take the function's defaults."""

    def __init__(self, name: str, function: Callable):
        self.function = function
        self.custom_op = torch.library.custom_op(name, mutates_args=())(function)
        self._init_fn = function  # the Python body, where tools look for a custom op's (compile audit, tracker)
        self._defaults = tuple(p.default for p in inspect.signature(function).parameters.values())
        self._arity = len(self._defaults)
        # the positions of the Tensor and Optional[Tensor] arguments, from the custom op's schema
        any_tensor = torch._C.OptionalType.ofTensor()
        self._tensor_positions = tuple(i for i, argument in enumerate(self.custom_op._opoverload._schema.arguments)
                                       if argument.type.isSubtypeOf(any_tensor))
        self._eager_apply: Optional[Callable] = None  # the eager autograd.Function's apply, once registered
        self.name = name
        # a Tensor[] return: autograd tracks the tensors of a Function's tuple output, not those in a list, so the
        # Functions below return a tuple, which `_returning` hands back as the op's list
        returns = self.custom_op._opoverload._schema.returns
        self._returns_list = len(returns) == 1 and isinstance(returns[0].type, torch._C.ListType)
        self._differentiable_apply = self._returning(
            differentiable_function(self.custom_op, name, returns_list=self._returns_list).apply)

    def _returning(self, apply: Callable) -> Callable:
        """A Function's apply, handing back a list where the op returns one (the Function a tuple)."""
        return (lambda *args: list(apply(*args))) if self._returns_list else apply

    def register_fake(self, fake: Callable) -> Callable:
        self.custom_op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        self._differentiable_apply = self._returning(differentiable_function(
            self.custom_op, self.name, setup_context, backward, self._returns_list).apply)
        forward_function, setup_function, backward_function = self.function, setup_context, backward
        returns_list = self._returns_list

        name = self.name

        class EagerFunction(torch.autograd.Function):
            # forward with ctx, not a separate setup_context: autograd.Function binds the arguments of a
            # ctx-less forward to its signature on every call (inspect.signature: ~50 us)
            @staticmethod
            def forward(ctx, *args):
                output = forward_function(*args)
                setup_function(ctx, args, output)
                return tuple(output) if returns_list else output

            @staticmethod
            def backward(ctx, *grads):
                return once_differentiable(name, backward_function(ctx, *grads), ctx, grads)

        EagerFunction.__name__ = EagerFunction.__qualname__ = f"{forward_function.__name__}_eager"
        self._eager_apply = self._returning(c_apply(EagerFunction))

    def __call__(self, *args):
        if len(args) < self._arity:
            args += self._defaults[len(args):]
        # tracing(), inline: this runs on every fused op call, and a Python call is a microsecond's part
        if _ALWAYS_CUSTOM_OP[0] or _is_compiling() or _dispatch_modes() or _functorch_transforms():
            return self._traced(args)
        if _FORWARD_AD._current_level >= 0:  # inside forward-mode AD's dual_level: tangents need the jvp rule
            return self._differentiable_apply(*args)
        # one pass: a tensor that is not a plain one on a real device takes the custom op (meta tensors its
        # shape-only fake registration); any that requires grad takes autograd
        differentiable = self._eager_apply is not None and torch.is_grad_enabled()
        requires_grad = False
        for i in self._tensor_positions:
            a = args[i]
            if a is not None:
                if type(a) not in _PLAIN_TENSORS or a.is_meta:
                    return self.custom_op(*args)
                if differentiable and not requires_grad:
                    requires_grad = a.requires_grad
        if requires_grad:
            return self._eager_apply(*args)
        return self.function(*args)

    def _traced(self, args: tuple):
        """The custom op, but under torch.func.grad or jvp (not compiled, no dispatch mode) the new-style
        autograd.Function those need: the custom op's own autograd is an old-style one, which they refuse
        (pytorch/pytorch#170834), and under jvp it would give zero tangents rather than an error."""
        if not (_is_compiling() or _dispatch_modes()) and _functorch_transforms():
            if _innermost_transform().key() in _DIFFERENTIATING:
                return self._differentiable_apply(*args)
        return self.custom_op(*args)


def runs_directly(*tensors: torch.Tensor) -> bool:
    """Whether a fused op called now on these tensors would run its host function directly (FusedOp.__call__'s
    eager path): nothing traced, no forward-mode AD, each tensor (None skipped) a plain one on a real device. A
    shortcut past the op (an in-place inference call) runs only then; elsewhere the op's call does what the
    shortcut cannot (a tracer's or a meta tensor's shape-only registration, a tangent refused by name)."""
    if (_ALWAYS_CUSTOM_OP[0] or _is_compiling() or _dispatch_modes() or _functorch_transforms()
            or _FORWARD_AD._current_level >= 0):
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or t.is_meta):
            return False
    return True


def eager_autograd() -> bool:
    """Whether a differentiable fused op call now takes the eager path (its EagerFunction, as FusedOp.__call__
    decides): grad mode on, nothing traced or transformed, no forward-mode AD, no always_custom_op."""
    return torch.is_grad_enabled() and not (_ALWAYS_CUSTOM_OP[0] or _is_compiling() or _dispatch_modes()
                                            or _functorch_transforms()) and _FORWARD_AD._current_level < 0


# True inside always_custom_op(): eager calls take the custom op too, as before this module (the host suite's
# "fastbert-custom-op" rows, the measurement behind the choice)
_ALWAYS_CUSTOM_OP = [False]


@contextlib.contextmanager
def always_custom_op():
    """Every fused op call through its torch.library custom op while entered, in eager mode too."""
    previous, _ALWAYS_CUSTOM_OP[0] = _ALWAYS_CUSTOM_OP[0], True
    try:
        yield
    finally:
        _ALWAYS_CUSTOM_OP[0] = previous


def c_apply(function_class: type) -> Callable:
    """function_class's apply: autograd's own, without Function.apply's Python layer (functorch's unwrapping, ~2 us
    a call; for a new-style Function, binding the arguments to forward's signature, ~15 us). For the eager path
    only, which never runs under a torch.func transform or torch.compile (`tracing`): those need that layer."""
    return _AUTOGRAD_APPLY.__get__(None, function_class)


def differentiable_function(custom_op, name: str, setup_context: Optional[Callable] = None,
                            backward: Optional[Callable] = None, returns_list: bool = False) -> type:
    """custom_op as a new-style torch.autograd.Function (forward without ctx, setup_context apart), which
    torch.func's transforms accept: the registered setup_context and backward, none for an op without them
    (an inference op or a backward op, which the ops never differentiate). It has no forward-mode derivative:
    its jvp raises, rather than leaving the tangents out (a jvp Dynamo would refuse, but torch.compile traces the
    custom op instead). Called through Function.apply's Python layer (which hands it to torch.func), so only where
    that is needed; the eager path keeps its old-style Function. returns_list: the op returns a Tensor[], which
    forward returns as a tuple (autograd tracks no tensor in a list)."""

    class DifferentiableFunction(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            output = custom_op(*args)
            return tuple(output) if returns_list else output

        @staticmethod
        def setup_context(ctx, inputs, output):
            if setup_context is not None:
                setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            if backward is None:
                raise RuntimeError(f"{name} has no backward: fastbert differentiates its training op instead")
            return once_differentiable(name, backward(ctx, *grads), ctx, grads)

        @staticmethod
        def jvp(ctx, *tangents):
            raise NotImplementedError(
                f"{name} has no forward-mode derivative (torch.func.jvp, torch.autograd.forward_ad): fastbert's "
                "kernels have backward rules only; backend='torch' runs PyTorch's own ops, which have forward-mode "
                "rules (the MLM cross entropy excepted)")

        @staticmethod
        def vmap(info, in_dims, *args):  # under torch.func.vmap, below a grad or jvp
            raise NotImplementedError(f"{name} has no batching rule for torch.func.vmap: run with backend='torch' "
                                      "for PyTorch's own ops")

    DifferentiableFunction.__name__ = DifferentiableFunction.__qualname__ = f"{name.split('::')[-1]}_function"
    return DifferentiableFunction


def as_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t in dtype: a backward's gradient going back to its input's or parameter's dtype; None stays None."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def once_differentiable(name: str, gradients: tuple, ctx, grads: tuple) -> tuple:
    """A backward's gradients (None where none), returned as they are, except where the backward runs to be
    differentiated again (create_graph=True: a gradient penalty, a Hessian-vector product, nested
    torch.func.grad) and they depend on the graph: the kernels' backward is not differentiable, so a second
    derivative through it would take them for constants and come out wrong. There their graph ends in a node that
    raises naming the op, linked to what they depend on (the saved tensors and incoming gradients that require
    grad), so that differentiating towards any of those reaches it (torch.autograd.function.once_differentiable
    links it to the incoming gradients alone, which torch.autograd.grad towards an input passes by)."""
    if not torch.is_grad_enabled():
        return gradients
    refusal = (f"{name} has no double backward (create_graph=True, nested torch.func.grad): fastbert's backward "
               "kernels are not differentiable; backend='torch' runs PyTorch's own ops, which have one (the MLM cross "
               "entropy excepted)")
    if _functorch_transforms():  # torch.func's grad always keeps the graph: refused where an outer level would use it
        if sum(level.key() in _DIFFERENTIATING for level in torch._C._functorch.get_interpreter_stack()) > 1:
            raise RuntimeError(refusal)
        return gradients
    depends = [t for t in (*ctx.saved_tensors, *grads) if t is not None and t.requires_grad]
    if not depends:  # constants of the graph: their second derivative is zero, as it comes out
        return gradients
    refuse = torch._C._functions.DelayedError(refusal.encode(), len(gradients) + len(depends))
    refused = refuse(*(None if g is None else g.detach().requires_grad_() for g in gradients), *depends)
    return refused[:len(gradients)]


def fused_op(name: str) -> Callable[[Callable], FusedOp]:
    """Decorator: `@fused_op("fastbert::layer_norm_fwd")` over a host function (annotated as a custom op's)."""
    return lambda function: FusedOp(name, function)


def register_no_backward(op: FusedOp, kept: str, instead: str) -> None:
    """The autograd of an inference op, which keeps no `kept` for a backward: its callers never run it on inputs
    that need a gradient (`backward_follows`), and a direct call that did gets an error at backward naming what
    to call `instead`, through the eager call and the custom op alike, rather than zero or no gradients."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"{op.name} keeps no {kept}, so it has no backward: call {instead}, which picks it "
                           "when an input requires grad")

    op.register_autograd(refuse, setup_context=lambda ctx, inputs, output: None)


def backward_follows(tensors) -> bool:
    """Whether a backward follows an op on these tensors (None skipped): grad mode on and an input that requires
    grad. It picks a fused op's training entrance over its inference one (which keeps nothing for a backward), and
    fastbert.paths' measured direction. A loop, not any() over a generator (about twice the host time): it runs
    on every call of such an op."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


_NONE_TYPE = type(None)


def or_empty(like: torch.Tensor, *tensors: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """tensors with a new empty [0] (like's dtype and device) for each None: a fused op's backward returns a
    gradient nobody needs (autograd's needs_input_grad) that way, since a custom op returns tensors, and
    never one tensor twice."""
    # no generator (each item a Python call): this runs on every backward
    if _NONE_TYPE not in map(type, tensors):
        return tensors
    filled = list(tensors)
    for i, t in enumerate(filled):
        if t is None:
            filled[i] = like.new_empty(0)
    return tuple(filled)
