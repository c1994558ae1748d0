#!/usr/bin/env bash
# The whole pipeline on the embedded default (this Python's standard library as the corpus), then the
# benchmark against plain decoding and the transformers peers:
#   bash scripts/quickstart.sh [--preset quick|cpu] [--arch gpt2|llama|qwen2|mistral] [--out RUN] [--limit N]
# quick (default): minutes of training, 13-28 minutes in all on 2 cores by CPU, set-up included;
# cpu: the README's headline models (80-120 minutes of training on 2 AVX-512 cores, about three times that with
# AVX2 alone). --arch: the oracle's architecture (GPT-2 by default; the draft is of the oracle's family), its run
# in runs/PRESET-ARCH. Re-running reuses every finished step and resumes an interrupted training (Ctrl-C saves its step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset=quick
arch=gpt2
run=""
limit=""
while [ $# -gt 0 ]; do
    case "$1" in
        --preset) preset="$2"; shift 2 ;;
        --arch) arch="$2"; shift 2 ;;
        --out) run="$2"; shift 2 ;;
        --limit) limit="$2"; shift 2 ;;
        -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1; see bash scripts/quickstart.sh --help" >&2; exit 2 ;;
    esac
done
case "$arch" in
    gpt2) suffix="" ;;
    llama|qwen2|mistral) suffix="-$arch" ;;
    *) echo "error: unknown architecture $arch; use gpt2, llama, qwen2 or mistral" >&2; exit 2 ;;
esac
case "$preset" in
    quick) run="${run:-$root/runs/quick$suffix}"; limit="${limit:-10}" ;;
    cpu) run="${run:-$root/runs/${suffix:+cpu}${suffix:-default}}"; limit="${limit:-50}" ;;
    *) echo "error: unknown preset $preset; use quick or cpu" >&2; exit 2 ;;
esac
bash "$root/scripts/setup.sh"
py="$root/.venv/bin/python"
cd "$root"

# stage TITLE: close the previous stage with its time, open this one
started=$SECONDS
stage_start=""
stage() {
    [ -n "$stage_start" ] && echo "   ($((SECONDS - stage_start)) s)"
    stage_start=$SECONDS
    echo "$1"
}

# train MODEL SCRIPT ARGS...: skip a finished model, resume an interrupted one
train() {
    local out="$1" script="$2"; shift 2
    if [ -f "$out/config.json" ]; then
        echo "   already trained (remove $out to retrain)"
        return
    fi
    local again=()  # this script's own earlier attempt: continue it (from its last checkpoint, or from what it generated)
    if [ -f "$out-train/args.json" ]; then again=(--resume); fi
    "$py" "$script" --preset "$preset" --out "$out" --data "$run/data" "$@" "${again[@]}"
}

stage "== 1/6 data: corpus, tokenizer, token shards, prompts -> $run"
if [ -f "$run/data/meta.json" ]; then
    echo "   already prepared (remove $run to rebuild it and everything built on it)"
else
    "$py" -m data.prepare --out "$run"
fi

stage "== 2/6 oracle ($preset preset) -> $run/oracle"
train "$run/oracle" train/finetune_oracle.py --arch "$arch"

stage "== 3/6 draft, distilled from the oracle -> $run/draft"
train "$run/draft" train/distill_draft.py --teacher "$run/oracle"

stage "== 4/6 Katz trigram -> $run/ngram"
table_loads() {  # a table of this version (an earlier version's is refused with the command that rebuilds it)
    "$py" -c "import sys; from decode.models.successors import SuccessorTable; SuccessorTable.load(sys.argv[1])" "$1" 2>/dev/null
}
if [ -f "$run/ngram/successors.npz" ] && table_loads "$run/ngram/successors.npz"; then
    echo "   already built (remove $run/ngram to rebuild)"
elif [ -f "$run/ngram/successors.npz" ]; then
    echo "   $run/ngram/successors.npz cannot be read by this version (an earlier version's table, or damaged): rebuilding the trigram"
    "$py" ngram/build_katz.py --out "$run/ngram" --overwrite
else
    "$py" ngram/build_katz.py --out "$run/ngram"
fi

# plan and decode in the dtype the oracle is calibrated faster in on this CPU (timed once and kept; docs/decoding.md,
# "Calibration")
dtype=$("$py" -c "import sys; from decode.models.precision import auto_dtype; print(auto_dtype('cpu', None, sys.argv[1], calibrate=True)[0])" "$run/oracle")

stage "== 5/6 plan each method's tree for these models on this CPU ($dtype), greedy and top-k 50 -> $run/plan*.json"
current_plan() {  # a plan of this version, in this dtype, for these loads ($2: its levels past one), newer than the models
    "$py" -c "import json, sys; from decode.plan_file import PLAN_VERSION; plan = json.load(open(sys.argv[1]));
sys.exit(plan.get('version') != PLAN_VERSION or plan['identity']['dtype'] != sys.argv[2]
         or ','.join(plan.get('concurrency', {})) != sys.argv[3])" "$1" "$dtype" "$2" 2>/dev/null \
        && [ "$1" -nt "$run/oracle/model.safetensors" ] && [ "$1" -nt "$run/draft/model.safetensors" ] \
        && [ "$1" -nt "$run/ngram/successors.npz" ]
}
# greedy decoding's plan, for 1, 2 and 4 requests in flight (a server switches policies by its load), and sampling's
# at T = 1, top-k 50 (a request at another setting borrows the nearer one); sampled plans choose chains on a CPU, so
# trees of up to 16 nodes are screened for it (64 took twice as long)
for setting in "plan.json:--concurrency 1,2,4" "plan-t1-k50-p1.json:--temperature 1 --top-k 50 --max-budget 16"; do
    file="${setting%%:*}" flags=() levels=""
    read -r -a flags <<< "${setting#*:}"
    [[ "${setting#*:}" =~ --concurrency\ 1,([0-9,]+) ]] && levels="${BASH_REMATCH[1]}"
    if current_plan "$run/$file" "$levels"; then
        echo "   $file: already planned for these models in $dtype by this version (remove it to re-plan)"
    else
        "$py" -m decode.plan --run "$run" --dtype "$dtype" --calibration 16 --screen 4 --project-oracle gpt2-large \
            "${flags[@]}" --overwrite
    fi
done

stage "== 6/6 benchmark: greedy, $limit prompts x 128 new tokens"
mkdir -p "$run/bench"
"$py" -m decode.bench --run "$run" --limit "$limit" --max-new-tokens 128 --dtype "$dtype" \
    --out "$run/bench/greedy.json" --plot "$run/bench/greedy.png" --overwrite
echo "   ($((SECONDS - stage_start)) s; $((SECONDS - started)) s in all, set-up not counted)"
