"""The code passes the linter with the repository's configuration (pyproject.toml's [tool.ruff])."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    checked = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_library_type_checks():
    """mypy over decode/ with pyproject.toml's settings (no cache: a cache from other code can hide an error)."""
    checked = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", os.devnull], cwd=ROOT, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def layer(module: str) -> str:
    """A module's layer: its folder under decode/ (decode.models, decode.planning, ...), else itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "decode" and len(parts) > 2 else module


MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for folder in ("data", "train", "ngram", "decode") for p in (ROOT / folder).rglob("*.py")}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """The repository's modules a file imports, with the line: at its top level and inside its functions alike (an
    import a function defers still runs), but not under `if TYPE_CHECKING:` (which never runs)."""
    import ast

    found = []

    def visit(node) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.module:  # `from decode import native` imports decode.native
            found.extend((f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module, node.lineno)
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(target, line) for target, line in found if target in MODULES]


def test_the_layers_import_each_other_in_no_circle():
    imports = {}  # layer -> {layer it imports: where}
    for name, path in MODULES.items():
        for target, line in imports_of(path):
            if layer(target) != layer(name):
                imports.setdefault(layer(name), {}).setdefault(layer(target), f"{name}:{line}")

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(imports.get(here, ()))
        return False

    circles = sorted(f"{where} imports {b}, which imports {a} back" for a, targets in imports.items()
                     for b, where in targets.items() if reaches(b, a))
    assert not circles, "\n".join(circles)


def test_no_command_imports_another():
    """decode/cli holds thin adapters: a command's library lives in the layers below, which every command may use."""
    commands = {name for name, path in MODULES.items()
                if name.startswith("decode.cli.") and "def main(" in path.read_text()}
    crossing = sorted(f"{name}:{line} imports {target}" for name in commands for target, line in imports_of(MODULES[name])
                      if target in commands and target != name)
    assert not crossing, crossing


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("data", "train", "ngram", "decode", "scripts")
            for p in (ROOT / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by what their parts do: {long}"
