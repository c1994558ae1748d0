#!/usr/bin/env bash
# Creates .venv in the repository root and installs the toolkit into it (editable). Idempotent: a
# second run only checks and returns within seconds.
#
#   bash scripts/setup.sh            # then: source .venv/bin/activate
#   bash scripts/setup.sh --test     # with the test extra too: pytest, and kenlm (compiled from source,
#                                    # about a minute), which the tests use to read our ARPA files
#
# torch is pinned to 2.13.0 where we install it: a wheel pip finds without an index (find-links, a
# local wheelhouse) first; else, on a machine without an NVIDIA GPU, PyTorch's CPU index, because PyPI's
# Linux torch is the CUDA build (several GB); with one, PyPI's. Users with GPUs can install their own
# torch into .venv first; setup.sh keeps any torch it finds. TORCH_INDEX_URL picks the index.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
stamp="$venv/.installed" target="$root" modules="torch, transformers, data, fastapi, uvicorn" what="its dependencies"
case "${1:-}" in
    "") ;;
    --test) stamp="$venv/.installed-test" target="$root[test]" modules="$modules, pytest, kenlm, openai, httpx, schemathesis, gguf, ruff, mypy"
            what="its dependencies and the test extra (kenlm compiles from source, about a minute)" ;;
    *) echo "error: unknown argument $1; usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"

# Fast path: nothing changed since the last complete install.
if [ -f "$stamp" ] && [ "$stamp" -nt "$root/pyproject.toml" ] && "$py" -c "import $modules" 2>/dev/null; then
    exit 0
fi

if ! "$py" -c "import torch" 2>/dev/null; then
    index=""
    if ! "$py" -m pip install --quiet --dry-run --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
        index="${TORCH_INDEX_URL:-$(command -v nvidia-smi >/dev/null || echo "https://download.pytorch.org/whl/cpu")}"
    fi
    echo "setup: installing torch==2.13.0${index:+ from $index}"
    "$py" -m pip install --quiet ${index:+--index-url "$index"} "torch==2.13.0" 2> >(grep -v "is ignored: it is neither" >&2)
fi
echo "setup: installing the toolkit and $what"
"$py" -m pip install --quiet -e "$target" 2> >(grep -v "is ignored: it is neither" >&2)
touch "$stamp"
echo "setup: done ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
