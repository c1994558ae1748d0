"""The code passes the linter with the repository's configuration (pyproject.toml's [tool.ruff])."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    checked = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def layer(module: str) -> str:
    """A module's layer: its folder under decode/ (decode.models, decode.planning, ...), else itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "decode" and len(parts) > 2 else module


def test_no_layer_imports_a_layer_that_imports_it_back():
    import ast

    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for folder in ("data", "train", "ngram", "decode") for p in (ROOT / folder).rglob("*.py")}
    imports = {}  # layer -> layers its modules import at their top level
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:  # `from decode import native` imports decode.native
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            else:
                targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for target in targets:
                if target in modules and layer(target) != layer(name):
                    imports.setdefault(layer(name), set()).add(layer(target))
    back = sorted((a, b) for a, bs in imports.items() for b in bs if a < b and a in imports.get(b, ()))
    assert not back, f"layers that import each other: {back}"


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("data", "train", "ngram", "decode", "scripts")
            for p in (ROOT / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by what their parts do: {long}"
