"""Imports go one way, down (DESIGN.md's layers): no module of fastbert imports, directly or through others,
a module that imports it back. Every import counts, also those inside functions (a lazy import is a circle
put off, not removed); only `if TYPE_CHECKING:` imports, which never run, are left out."""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def module_files() -> dict[str, pathlib.Path]:
    """fastbert's module names -> files (kernels/ is installed as fastbert.kernels)."""
    files = {}
    for folder, package in (("fastbert", "fastbert"), ("kernels", "fastbert.kernels")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            files[name] = path
    return files


def imported_modules(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The fastbert modules `name` imports (a package's __init__ only where a name is not a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
                   for statement in block.body for node in ast.walk(statement)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t for t in submodules if t in modules] or [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target not in (name, "fastbert"):
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    files = module_files()
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_the_import_graph_has_no_circle():
    assert import_cycles() == []


def test_the_check_sees_a_circle_and_a_lazy_import(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other, one of them inside a function, are a circle."""
    for folder in ("fastbert", "kernels"):
        (tmp_path / folder).mkdir()
    (tmp_path / "fastbert" / "__init__.py").write_text("")
    (tmp_path / "fastbert" / "low.py").write_text("def f():\n    from fastbert import high\n")
    (tmp_path / "fastbert" / "high.py").write_text("from fastbert.low import f\n")
    (tmp_path / "fastbert" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastbert import high\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    cycles = import_cycles()
    assert cycles == [["fastbert.high", "fastbert.low", "fastbert.high"]]


SIMULATED = sorted(name for name in module_files() if name.startswith("fastbert.simulated."))
# the modules of the circle issue 25 took apart (bench/memory_cases -> memory_plan -> train/step -> train/run ->
# bench/memory_cases), beside every module of the simulated package
ENTRY_POINTS = SIMULATED + ["fastbert.train.run", "fastbert.bench.memory_cases"]
ALLOWED_FROM_TRAIN = {"fastbert.train", "fastbert.train.optim"}  # the optimizers a planned step updates with


def forbidden_for_simulated(modules) -> list[str]:
    """The modules of `modules` that fastbert.simulated must not import: fastbert.bench's, and fastbert.train's
    other than the optimizers."""
    return sorted(m for m in modules if m == "fastbert.bench" or m.startswith("fastbert.bench.")
                  or (m.startswith("fastbert.train") and m not in ALLOWED_FROM_TRAIN))


@pytest.mark.slow(reason="a fresh interpreter importing torch per entry point; the import graph's circles are "
                         "test_the_import_graph_has_no_circle's")
def test_each_module_imports_first_in_a_fresh_interpreter_and_simulated_stays_below():
    """Every entry point imported first, in a fresh interpreter each. A circle fails only while one of its modules
    is half-initialised, that is within the chain of imports one statement starts, so which module starts it is
    the whole of the order: what is imported later finds the first one's modules complete. A simulated module
    must leave no fastbert.bench module and no fastbert.train module but optim in sys.modules."""
    import json
    import os
    import subprocess

    code = ("import importlib, json, sys\nimportlib.import_module(sys.argv[1])\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fastbert'))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for first in ENTRY_POINTS:  # all started at once: each spends most of its time importing torch
        runs[first] = subprocess.Popen([sys.executable, "-c", code, first], cwd=ROOT, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for first, run in runs.items():
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"importing {first} first:\n{err[-3000:]}"
        if first in SIMULATED:
            assert forbidden_for_simulated(json.loads(out.strip().splitlines()[-1])) == [], first


def test_simulated_reaches_no_bench_or_train_module_through_any_import():
    """The same, for every import (those inside functions too) and everything they import in turn."""
    files = module_files()
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    reached, todo = set(), list(SIMULATED)
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert SIMULATED and forbidden_for_simulated(reached) == []
