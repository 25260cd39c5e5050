"""The package's shape, read from its source with `ast`: no import cycles between its modules (imports under
TYPE_CHECKING and inside functions included), methods never import the evaluation harness, no module but
engine/session.py reaches into a Session's private members, and the root's package folders hide no installed
package."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"nodekv": "nodekv", "nodekv.engine": "engine", "nodekv.kernels": "kernels", "nodekv.methods": "methods",
            "nodekv.evaluation": "evaluation", "nodekv.bench": "bench"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its __init__.py)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (`from x import y` counts x.y when that is a
    module, else x)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import nodekv.engine.engine` names the module itself
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # a package's __init__ that re-exports its own modules is not a cycle with them: edges from a package into its
    # own submodules are the re-export, not a dependency
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_methods_never_import_the_evaluation_harness():
    known = modules()
    offenders = {name: sorted(t for t in imports(name, path, known) if t.startswith("nodekv.evaluation"))
                 for name, path in known.items() if name.startswith("nodekv.methods")}
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_session_module_touches_a_sessions_private_members():
    private = {node.name for node in ast.walk(ast.parse((ROOT / "engine" / "session.py").read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__")}
    private |= {"_generation", "_index", "_logits", "_mass"}  # its private attributes
    pattern = re.compile(r"\.(" + "|".join(sorted(private)) + r")\b")
    hits = []
    for name, path in modules().items():
        if path == ROOT / "engine" / "session.py":
            continue
        for k, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for m in pattern.finditer(code):
                if not code[:m.start()].endswith("self"):  # a class's own member of the same name
                    hits.append(f"{path.relative_to(ROOT)}:{k}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_root_folders_hide_no_installed_package():
    """The root's package folders are nodekv's subpackages (`nodekv.kernels` is kernels/); a top-level import of
    their names must find an installed package or nothing, never the folder. `python -m pytest` puts the root first
    on sys.path, and kernels/ then hid the `kernels` that transformers 5.x imports (tests/conftest.py takes the root
    off again)."""
    folders = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "nodekv")
    hidden = [name for name in folders if (spec := importlib.util.find_spec(name)) is not None and spec.origin
              and Path(spec.origin).resolve().is_relative_to(ROOT / name)]
    assert folders and not hidden, f"found as top-level packages from the repository root: {hidden}"
