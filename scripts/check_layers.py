"""Checks the import graph against the package's layer order; exits 1 with each offending import.

The layers, top to bottom (a layer imports only the layers listed for it, never one above)::

    app       the CLI, supervisor, in-process server, naive baseline, transcribe, eval
    server    the transports: gRPC servicer, HTTP / WebSocket, Google / Riva adapters, the frontend server
    frontend  sessions without a transport: session, engine client and pool, responses, quotas, snapshots
    engine    the engine process, IPC messages, scheduler, tick loop
    runtime   state slab, runner, CUDA graphs
    models    the streaming-model contract and the models
    audio     codecs, resampling, framing, WAV, VAD, endpointing     (below server; imports no engine)
    decoding  greedy CTC, beam search, lexicon, LM, text rules       (below server; imports no engine)
    secondpass  the Whisper second pass and its worker process       (below server; imports no torch, no grpc)
    base      cosystream, frames, logs, metrics
    api       cosystream.v1: the generated wire API and its client helpers

No module of the server layer or below it (but the engine, runtime and models) loads torch, checked at import
time in a subprocess as well as in the source: a frontend process never pays for torch (``FRONTEND_MODULES``),
nor does ``serve``'s supervisor, which only reads the engine's configuration (``SUPERVISOR_MODULES``).
No layer below the server imports gRPC or protobuf (``google.*``), nor the generated wire API: a session
knows nothing of its transport; the server maps its plain results to messages. Checked in the source and,
for the frontend's layers, at import time in a subprocess that refuses those packages.

``clients/`` may import only ``cosystream.v1``. There is no import cycle anywhere in the package,
``training/``, ``benchmarks/`` or ``clients/`` (imports inside functions count: they are cycles too).

    python scripts/check_layers.py [ROOT]
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ALLOWED: dict[str, set[str]] = {
    "api": set(),
    "base": set(),
    "audio": {"base"},
    "decoding": {"base", "models"},
    "models": {"base"},
    "runtime": {"models", "base"},
    "engine": {"runtime", "models", "base"},
    "secondpass": {"decoding", "base"},
    "frontend": {"engine", "audio", "decoding", "secondpass", "base"},
    "server": {"frontend", "engine", "runtime", "models", "audio", "decoding", "secondpass", "base", "api"},
    "app": {"server", "frontend", "engine", "runtime", "models", "audio", "decoding", "secondpass", "base", "api"},
}
# Third-party packages a layer must not import: no transport below the server (grpc, google.protobuf and
# google.rpc), and the second pass's worker process stays small (no torch).
_TRANSPORT = ("grpc", "google")
_BELOW_SERVER = ("frontend", "engine", "runtime", "models", "audio", "decoding", "base")
FORBIDDEN: dict[str, tuple[str, ...]] = {layer: _TRANSPORT for layer in _BELOW_SERVER}
FORBIDDEN["secondpass"] = ("torch", *_TRANSPORT)
_SUBPACKAGE_LAYERS = {"v1": "api", "app": "app", "server": "server", "engine": "engine", "runtime": "runtime"}
_SUBPACKAGE_LAYERS |= {"models": "models", "audio": "audio", "decoding": "decoding", "__main__": "app"}
_SUBPACKAGE_LAYERS |= {"secondpass": "secondpass", "frontend": "frontend"}
TREES = ("cosystream", "training", "benchmarks", "clients")
# What a frontend process imports, and the packages it must never load: its entry point, and every module of
# the layers it runs (the engine's IPC messages are its only module of the engine).
FRONTEND_MODULES = ("cosystream.app.frontend_process", "cosystream.engine.ipc", "cosystream.prctl")
BELOW_THE_SERVER = ("cosystream.frontend", "cosystream.audio", "cosystream.decoding", "cosystream.secondpass")
FRONTEND_PACKAGES = ("cosystream.server", *BELOW_THE_SERVER)
NEVER_IN_A_FRONTEND = ("torch",)
# What ``cosystream serve``'s supervisor (the CLI process) imports before it spawns the engine: its entry point,
# the serve command and the engine's configuration, read without the engine (``--compile-only`` and ``--naive``
# run a model in this process and may load torch; they import it inside the functions that do).
SUPERVISOR_MODULES = (
    "cosystream.app.cli",
    "cosystream.app.supervisor",
    "cosystream.app.commands.serve",
    "cosystream.app.commands.serve_config",
    "cosystream.engine.config",
    "cosystream.engine.launch",
    "cosystream.engine.adaptive",
    "cosystream.runtime.settings",
    "cosystream.model_files",
    "cosystream.metrics",
    "cosystream.audio.endpointing",
)
NEVER_BELOW_THE_SERVER = ("torch", "grpc", "google")
_IMPORT_PROBE = """
import importlib, pkgutil, sys, traceback
refused = set(sys.argv[1].split(","))
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in refused:
            raise ImportError(f"{name} loaded")
sys.meta_path.insert(0, Refuse())
names = [name for name in sys.argv[2].split(",") if name]
for package in filter(None, sys.argv[3].split(",")):
    names += [info.name for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:
        chain = [f.name for f in traceback.extract_tb(err.__traceback__) if "cosystream" in f.filename]
        print(f"{name}: {err} (through {' -> '.join(dict.fromkeys(chain)) or name})")
"""


def layer_of(module: str) -> str | None:
    """The layer of a ``cosystream`` module, or None outside the package."""
    parts = module.split(".")
    if parts[0] != "cosystream":
        return None
    if len(parts) == 1:
        return "base"
    return _SUBPACKAGE_LAYERS.get(parts[1], "base")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(root: Path, path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, resolved to the modules of the tree where it names one."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else base))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check(root: Path) -> list[str]:
    files = {module_name(root, p): p for tree in TREES for p in sorted((root / tree).rglob("*.py"))}
    modules = set(files)
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        where = path.relative_to(root)
        own = layer_of(name)
        for line, target in imports(root, path, modules):
            if target not in modules and not target.startswith("cosystream"):
                if target.split(".")[0] in FORBIDDEN.get(own, ()):
                    problems.append(f"{where}:{line}: {own} imports {target}, which that layer must not")
                continue  # a third-party or standard-library module
            if target != name:
                graph.setdefault(name, set()).add(target)
            theirs = layer_of(target)
            if name.startswith("clients") and theirs is not None and theirs != "api":
                problems.append(f"{where}:{line}: a client imports {target}; clients use only cosystream.v1")
            if own is not None and theirs is not None and theirs != own and theirs not in ALLOWED[own]:
                problems.append(f"{where}:{line}: {own} imports {target} ({theirs}), against the layer order")
    for component in cycles(graph):
        problems.append("import cycle: " + " <-> ".join(component))
    return problems + process_imports(root)


def process_imports(root: Path) -> list[str]:
    """Import every module a frontend process runs, in a fresh interpreter refusing torch, every module of
    the layers below the server in one refusing torch, gRPC and protobuf too, and what ``serve``'s supervisor
    imports in one refusing torch: each one that would load them (an import inside a function counts once it
    runs: this checks only import time; tests/test_faults.py checks a serving supervisor's memory map)."""
    probes = (
        ("a frontend process would load torch", NEVER_IN_A_FRONTEND, FRONTEND_MODULES, FRONTEND_PACKAGES),
        ("a module below the server would load its transport", NEVER_BELOW_THE_SERVER, (), BELOW_THE_SERVER),
        ("the supervisor would load torch", NEVER_IN_A_FRONTEND, SUPERVISOR_MODULES, ()),
    )
    problems: list[str] = []
    for what, refused, modules, packages in probes:
        argv = [",".join(refused), ",".join(modules), ",".join(packages)]
        result = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE, *argv], cwd=root, capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            return [f"the import probe failed ({what}): {result.stderr.strip().splitlines()[-1:]}"]
        problems += [f"{what}: {line}" for line in result.stdout.splitlines()]
    return problems


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    problems = check(root)
    for problem in problems:
        print(problem)
    if problems:
        print(
            f"{len(problems)} layering problem(s); the rules: scripts/check_layers.py's docstring", file=sys.stderr
        )
        return 1
    print("layers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
