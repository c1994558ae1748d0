#!/usr/bin/env bash
# The whole pipeline on the embedded default (this Python's standard library as the corpus):
#   bash scripts/quickstart.sh [--out RUN]
# Re-running reuses the steps that already finished.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run="$root/runs/default"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) run="$2"; shift 2 ;;
        -h|--help) sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1; see bash scripts/quickstart.sh --help" >&2; exit 2 ;;
    esac
done
bash "$root/scripts/setup.sh"
py="$root/.venv/bin/python"
cd "$root"

echo "== 1. data: corpus, tokenizer, token shards, prompts -> $run"
if [ -f "$run/data/meta.json" ]; then
    echo "   already prepared (remove $run/data to rebuild)"
else
    "$py" -m data.prepare --out "$run"
fi

echo
echo "The data step is done: $run holds tokenizer/, data/ and prompts.jsonl."
echo "Training, the Katz trigram and decoding are not in this toolkit yet; the quickstart stops here."
