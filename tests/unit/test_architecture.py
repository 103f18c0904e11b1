"""The package's imports keep the layers of ``docs/architecture.md``: every import (at module level
or inside a function) runs down the layers, no two modules import each other through any chain,
and the engine's step imports neither checkpoints nor the doctor (the builder wires them in).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raydeep"

# Low to high: a module may import its own layer and the layers below it. ``raydeep`` itself
# (the façade, ``raydeep/__init__.py``) and ``raydeep.checkpointing`` (DeepSpeed's alias of
# ``raydeep.activation.deepspeed_api``) sit on top.
LAYERS = [
    {"errors", "console_lines", "train_state", "estimate", "models", "data", "storage", "metrics"},
    {"comm", "accelerator"},  # thin collectives over torch.distributed; DeepSpeed's device object
    {"compression"},  # 1-bit packing, the compressed all-reduce, the compressed optimizers
    {"optim", "precision"},  # DeepSpeed's optimizer/scheduler/scaler semantics: the config checks names here
    {"config"},
    {"zero", "monitor", "activation"},
    {"tier"},
    {"checkpoint", "doctor"},
    {"engine"},
    {"ray", "report", "bench", "tune", "autotune"},
    {"cli", "__main__", "demo", "checkpointing", "compat"},  # compat: the `deepspeed` module name for Hugging Face
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The raydeep modules ``path`` imports anywhere in it (resolved to the module, not the name)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("raydeep"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = defaultdict(set)
    for module, path in known.items():
        for target in imports(path, known):
            # a module's own package (its __init__ runs first anyway) and the façade are not edges
            if target != module and target != "raydeep" and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


def top(module: str) -> str:
    return module.split(".")[1] if "." in module else "raydeep"


def test_every_package_has_a_layer():
    assert {top(m) for m in modules()} - {"raydeep"} <= set(LAYER), "a new top-level module needs a layer here"


def test_imports_run_down_the_layers():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if top(a) != "raydeep" and LAYER[top(b)] > LAYER[top(a)]]
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    edges, index, low, stack, on_stack, cycles = graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                cycles.append(sorted(component + [v]))

    for module in list(modules()):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_engine_step_imports_neither_checkpoints_nor_the_doctor():
    reached = {top(target) for target in graph()["raydeep.engine.engine"]}
    assert not reached & {"checkpoint", "doctor", "ray", "tier"}, reached
