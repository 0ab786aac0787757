"""The library's import graph has no circles: every `import` of a jaxinfer module, at the top of a file
or inside a function, read from the source."""

import ast
from pathlib import Path

import jaxinfer

ROOT = Path(jaxinfer.__file__).parent


def _modules() -> dict[str, Path]:
    """jaxinfer.* module name → its file, for the library itself (not the CLI or the bundled models)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] in ("cli", "models"):
            continue
        name = ".".join(("jaxinfer",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The jaxinfer modules `name` imports (`from jaxinfer import x` names a module where x is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, a level up per dot after the first
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
    return {m for m in out if m in modules and m != name}


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # a package's own __init__ importing its submodules is not a circle through them
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" → ".join(c) for c in circles)
    assert len(modules) > 20 and graph["jaxinfer.loading"]  # the walk found the library
