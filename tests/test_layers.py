"""The layers import downward only (docs/design-decisions.md, "Layers"): common -> kvstore -> model
-> engine -> worker -> gateway -> cli. Read from the source (every import, also those inside functions and
under TYPE_CHECKING), so a new upward import or a cycle between files fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("baton", "kvstore", "gateway", "prefill_worker", "decode_worker")

# Path prefix (relative to the repository) -> layer; the longest prefix wins.
LAYERS = {
    "baton/common/": 0,
    "kvstore/": 1,
    "baton/model/": 2,  # numerics: weights, attention, linear ops, kernels
    "baton/engine/": 3,  # scheduling: requests, blocks, speculation policy, the connector
    "baton/llm.py": 3,  # the offline API: an engine in a loop
    "baton/worker/": 4,
    "prefill_worker/": 4,
    "decode_worker/": 4,
    "gateway/": 5,
    "baton/cli/": 6,
    "baton/__init__.py": 6,  # the package's front: `from baton import LLM, SamplingParams`
}
NAMES = ["common", "kvstore", "model", "engine", "worker", "gateway", "cli"]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    """First-party module name -> its file."""
    return {_module_of(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _layer(path: Path) -> int:
    rel = path.relative_to(ROOT).as_posix()
    prefix = max((p for p in LAYERS if rel.startswith(p)), key=len, default=None)
    assert prefix is not None, f"{rel} is in no layer: add it to LAYERS"
    return LAYERS[prefix]


def _imports(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    return _imports_of(path.read_text(encoding="utf-8"), _module_of(path), modules, top_level_only)


def _imports_of(source: str, own: str, modules: dict[str, Path] | set[str], top_level_only: bool) -> set[str]:
    """The first-party modules `source` imports (`from a import b` names a.b when b is a module).
    `top_level_only`: what runs on import (also under `if TYPE_CHECKING:`), not inside functions."""
    tree = ast.parse(source)
    if top_level_only:  # what runs on import: module and class bodies, not function bodies
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            nodes.append(node)
            todo.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # the module the name is, or is inside of
                name = name.rpartition(".")[0]
            if name and name != "baton":  # `from baton import protocol` imports baton.protocol
                found.add(name)
    found.discard(own)
    return found


def test_every_import_runs_down_the_layers():
    modules = _files()
    upward = []
    for name, path in modules.items():
        mine = _layer(path)
        for target in _imports(path, modules, top_level_only=False):
            theirs = _layer(modules[target])
            if theirs > mine:
                upward.append(f"{name} ({NAMES[mine]}) imports {target} ({NAMES[theirs]})")
    assert not upward, "imports that run up a layer:\n" + "\n".join(sorted(upward))


def test_the_block_store_imports_nothing_from_baton_and_worker_kinds_not_each_other():
    modules = _files()
    wrong = []
    for name, path in modules.items():
        targets = _imports(path, modules, top_level_only=False)
        if name.startswith("kvstore"):
            wrong += [f"{name} imports {t}" for t in targets if not t.startswith("kvstore")]
        for kind, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker")):
            if name.startswith(kind):
                wrong += [f"{name} imports {t}" for t in targets if t.startswith(other)]
    assert not wrong, "\n".join(wrong)


def test_the_model_layer_has_one_door():
    """Above the model layer, code reaches the numerics through `baton.model.runtime` alone (its
    config, `load_runtime`, `ModelRuntime`): the engine schedules and never picks a kernel."""
    modules = _files()
    wrong = []
    for name, path in modules.items():
        if name.startswith("baton.model"):
            continue
        wrong += [f"{name} imports {t}" for t in _imports(path, modules, top_level_only=False)
                  if t.startswith("baton.model") and t != "baton.model.runtime"]
    assert not wrong, "imports past baton.model.runtime:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("top_level_only", [True, False], ids=["on-import", "with-function-imports"])
def test_no_import_cycle_between_files(top_level_only: bool):
    """No cycle among what runs on import, nor once the imports inside functions are counted too (a
    function-local import hides a cycle from Python, not from the design)."""
    modules = _files()
    graph = {name: _imports(path, modules, top_level_only=top_level_only) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(trail[trail.index(target):] + [target] if target in trail else [name, target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_import_and_a_cycle():
    """The rules above can fail: an engine module importing the gateway is upward, and two modules
    importing each other at the top are a cycle (while a function-local import is not)."""
    modules = _files()
    assert _imports_of("from gateway.app import create_app\n", "baton.engine.probe", modules, False) == {"gateway.app"}
    assert _layer(modules["gateway.app"]) > _layer(modules["baton.engine.llm_engine"])
    lazy = "class C:\n    def f(self):\n        from baton.engine import llm_engine\n"
    assert _imports_of(lazy, "x", modules, top_level_only=True) == set()
    assert _imports_of(lazy, "x", modules, top_level_only=False) == {"baton.engine", "baton.engine.llm_engine"}
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstore import keys\n"
    assert _imports_of(guarded, "x", modules, top_level_only=True) == {"kvstore", "kvstore.keys"}
