"""The package's import graph, read from the source (every import, those inside functions too):
no cycle, and nothing pointing back up its layers. The modules vLLM's patches ship import none of
the package outside what the series ship with them."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "magpie"

# Lower layers never import higher ones; within a layer, only modules of one folder import each
# other (the top-level modules are one folder: the patch tool, the release table, cli, files).
LAYERS = {
    "magpie": 0,
    "magpie.vllm_modules": 1,
    "magpie.serving": 1,
    "magpie.demo": 1,
    "magpie.nix": 1,
    "magpie.mtp_pruning": 2,
    "magpie.ple_ssd": 2,
    "magpie.measure": 3,
    "magpie.gpu": 3,
}
# What vLLM's patches ship (magpie/vllm_modules/ but its rendering code): standalone in a vLLM tree.
SHIPPED = {"magpie.vllm_modules.draft_vocab", "magpie.vllm_modules.ple_hash", "magpie.vllm_modules.ple_mmap"}
SHIPPED |= {"magpie.vllm_modules.ple_rows"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in mods else base)
        edges[name] = {t for t in targets if t in mods and t != name}
    return edges


def folder(name: str) -> str:
    """The folder (package) a module sits in; a package's __init__ sits in its parent."""
    mods = modules()
    if mods[name].name == "__init__.py":
        return name.rpartition(".")[0] or name
    return name.rpartition(".")[0]


def layer(name: str) -> int:
    if name == "magpie.__main__":
        return max(LAYERS.values()) + 1
    home = folder(name)
    while home not in LAYERS:
        home = home.rpartition(".")[0]
    return LAYERS[home]


def test_the_reader_sees_imports_inside_functions():
    edges = graph()
    # measure.machine imports serving.launch inside a function only.
    assert "magpie.serving.launch" in edges["magpie.measure.machine"]
    assert "magpie.cli" in edges["magpie.__main__"]


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)


def test_nothing_points_back_up():
    wrong = []
    for name, targets in graph().items():
        for target in targets:
            if layer(target) > layer(name) or (layer(target) == layer(name) and folder(target) != folder(name)):
                if target != "magpie":  # the package's own __init__ (its version, tool_command)
                    wrong.append(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_shipped_modules_import_only_each_other():
    edges = graph()
    for name in SHIPPED:
        assert edges[name] <= SHIPPED, (name, edges[name] - SHIPPED)
