"""The tests run where conftest's `device` fixture says: "cpu" under Triton's interpreter, "cuda" on a GPU. On
the first H100 run every test of test_ffn.py, test_geglu.py and test_family_triton.py, most of
test_layer_norm_residual.py and two Triton probes failed there: they asked for `device` (or not at all) and
made their tensors on the CPU, which the interpreter runs and a compiled kernel refuses. On the CPU machine
the two are one device, so this reads the test files instead (device_misuse says the rules)."""
import ast
import pathlib

import pytest

TESTS = sorted(pathlib.Path(__file__).parent.glob("test_*.py"))
# Tests of a command that chooses the device itself (the GPU where there is one), not the test
PICK_THEIR_OWN_DEVICE = {"test_classification_on_fastbert_kernels"}
# Tests that pass backend="triton" to the backend's resolution only: they launch nothing
RESOLVE_ONLY = {"test_explicit_backends_override_the_table"}


def _functions(path):
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _parameters(function) -> set[str]:
    arguments = function.args
    return {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}


def _names_used(function) -> set[str]:
    return {node.id for statement in function.body for node in ast.walk(statement) if isinstance(node, ast.Name)}


def _jitted(tree) -> set[str]:
    """Names of the file's own @triton.jit functions."""
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)}


def _launches_a_kernel(function, jitted) -> bool:
    """A launch `kernel[grid](...)` of one of the file's @triton.jit functions or of a kernel module's
    `..._kernel`."""
    for statement in function.body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launched = node.func.value
                if ((isinstance(launched, ast.Name) and launched.id in jitted)
                        or (isinstance(launched, ast.Attribute) and launched.attr.endswith("_kernel"))):
                    return True
    return False


def _asks_for_triton(function) -> bool:
    """A `backend="triton"` keyword in the function."""
    return any(isinstance(node, ast.keyword) and node.arg == "backend" and isinstance(node.value, ast.Constant)
               and node.value.value == "triton" for statement in function.body for node in ast.walk(statement))


def _cpu_strings(function) -> list[str]:
    return [node.value for statement in function.body for node in ast.walk(statement)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "cpu" in node.value]


def device_misuse(path) -> list[str]:
    """`name: why` for each function of the test file at `path` that breaks the rules: a test that asks for
    `device` uses it and names no "cpu" itself; a function that launches a Triton kernel takes `device`; a test
    that runs the Triton backend (itself or through a helper of its file) takes `device`; unless its name says
    it is about the CPU or the interpreter, or a command it runs picks the device, or it only resolves a
    backend's name."""
    found = []
    tree = ast.parse(path.read_text())
    jitted = _jitted(tree)
    functions = _functions(path)
    triton_helpers = {f.name for f in functions if _asks_for_triton(f)}
    for function in functions:
        takes_device = "device" in _parameters(function)
        is_test = function.name.startswith("test_")
        if is_test and takes_device and "device" not in _names_used(function):
            found.append(f"{function.name}: asks for `device` and never uses it")
        if is_test and takes_device and _cpu_strings(function):
            found.append(f"{function.name}: names the CPU ({_cpu_strings(function)[0]!r}) where the device is the "
                         f"fixture's")
        about_the_cpu = "cpu" in function.name or "interpreter" in function.name
        if _launches_a_kernel(function, jitted) and not takes_device and not about_the_cpu:
            found.append(f"{function.name}: launches a Triton kernel without taking `device`")
        if (is_test and not takes_device and not about_the_cpu
                and function.name not in PICK_THEIR_OWN_DEVICE | RESOLVE_ONLY
                and (triton_helpers & _names_used(function) or _asks_for_triton(function))):
            found.append(f"{function.name}: runs the Triton backend without taking `device`")
    return found


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_tests_run_on_the_device_fixture(path):
    assert device_misuse(path) == []


def test_the_rules_find_each_mistake(tmp_path):
    source = tmp_path / "test_sample.py"
    source.write_text(
        "@triton.jit\ndef kernel(x):\n    pass\n\n"
        "def test_unused(device):\n    x = torch.ones(3)\n\n"
        "def probe(n):\n    kernel[(1,)](torch.empty(n))\n    attn._attention_fwd_kernel[(1,)](n)\n\n"
        "def test_a_table_of_functions(device):\n    IMPLEMENTATIONS['torch'](device)\n\n"
        "def accelerated(model):\n    return fastbert.apply(model, backend='triton')\n\n"
        "def test_model():\n    accelerated(model())\n\n"
        "def test_message(device):\n    check(device, match='x is on meta, q on cpu')\n\n"
        "def test_used(device):\n    probe_on(device)\n")
    assert device_misuse(source) == [
        "test_unused: asks for `device` and never uses it",
        "probe: launches a Triton kernel without taking `device`",
        "test_model: runs the Triton backend without taking `device`",
        "test_message: names the CPU ('x is on meta, q on cpu') where the device is the fixture's"]
