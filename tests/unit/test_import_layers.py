"""Imports point one way: from the top of LAYERS down (docs/architecture.md, Layout).

Every module under src/shardserve is read with `ast`, so every import counts: at the top, inside
functions (the lazy ones) and under `if TYPE_CHECKING`. The test fails listing each import that
points up the table, and each import circle between modules of different folders.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import shardserve

ROOT = Path(shardserve.__file__).parent
PKG = "shardserve"

# Top to bottom. A folder (a subpackage) is named as such; a top-level module by its module name.
# A module may import its own layer and any layer below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    # The command line, the package root (the public names; `LLM` imported lazily) and __main__.
    ("cli", "__init__", "__main__"),
    ("server",),
    ("bench",),
    ("gateway",),  # the standalone HTTP router: places requests with router/'s policy
    # The offline API (its arguments and outputs) and its engine (in process or scheduler processes).
    ("llm", "llm_inputs", "llm_outputs", "llm_prompts", "engine_backends"),
    ("router",),  # in-server placement: the policy, prefix indexes, the --dp-size router process
    ("tokenizer",),
    ("launch",),
    ("scheduler",),
    ("engine",),
    ("models",),
    ("layers",),
    ("attention",),
    ("kvcache",),
    ("loader",),
    ("distributed",),
    ("ipc",),
    ("core", "sampling_params", "http_common"),  # they import only the modules below
    ("config", "platform", "native", "text", "structured_outputs", "chat_messages", "openai_errors", "logs",
     "multimodal"),
    ("model_config",),  # the model's shape: config re-exports it
    # Its rotary, and each architecture family's own keys, read from config.json: model_config
    # imports them (config the rotary too).
    ("rope_config", "arch_config"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = [PKG, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def unit(module: str) -> str:
    """The entry of LAYERS a module belongs to: its folder's name, or its own at the top level."""
    return module.split(".")[1] if "." in module else "__init__"


def folder(module: str) -> str:
    """The subpackage a module sits in; "" for the package root and its top-level modules."""
    top = ".".join(module.split(".")[:2])
    return unit(module) if "." in module and MODULES[top].name == "__init__.py" else ""


def _target(name: str) -> str:
    """The module an imported name lives in: `from a.b import c` imports module a.b.c if there is one."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module of this package) for every import in `module`, wherever it is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level` steps up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == PKG or name.startswith(PKG + "."):
                yield node.lineno, _target(name)


GRAPH = {m: sorted(set(imports(m))) for m in MODULES}


def test_every_module_has_a_layer():
    assert not sorted({unit(m) for m in MODULES} - RANK.keys())


def test_no_import_points_up():
    upward = [f"{MODULES[m].relative_to(ROOT.parent)}:{line}: {m} imports {t} ({unit(m)} -> {unit(t)})"
              for m, targets in GRAPH.items() for line, t in targets if RANK[unit(t)] < RANK[unit(m)]]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    edges = {m: sorted({t for _, t in targets} - {m}) for m, targets in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for m in edges:
        if m not in index:
            visit(m)
    return found


def test_no_circle_across_folders():
    across = [c for c in _cycles() if len({folder(m) for m in c}) > 1]
    assert not across, "import circles across folders:\n" + "\n".join(", ".join(c) for c in across)


def test_a_rank_imports_no_tokenizer_library():
    """A rank process (the stage worker and what it imports) loads no tokenizer unless a request
    needs one (a structured-output request): transformers' import would be a large part of every
    rank's start."""
    code = "import sys, shardserve.engine.stage_worker; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('transformers', 'tokenizers')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout[:500]
