#!/usr/bin/env bash
# Checks a CUDA machine, in stages that each stand alone:
#   bash scripts/gpu_check.sh tests            # the whole suite, CUDA tests included
#   bash scripts/gpu_check.sh train RUN        # GPT-2-small-sized oracle, draft, trigram (RUN/data prepared)
#   bash scripts/gpu_check.sh decode RUN       # exactness on CUDA, sampling, engine costs, plan, bench
#   bash scripts/gpu_check.sh brief RUN [LLAMA_RUN]  # a few minutes' checks in one command: the CUDA tests and
#                                              # a shorter training, the Llama pair's exactness with and without
#                                              # graphs, then its speed and the unplanned defaults' (greedy, top-k)
#   bash scripts/gpu_check.sh compiled RUN [LLAMA_RUN]  # --compile-layers: its CUDA tests, the forward at
#                                              # Qwen2.5-0.5B's shape, each pair's bench with and without it
#   bash scripts/gpu_check.sh plan RUN         # what brief leaves, in one command: a shorter
#                                              # training (and `--compile`'s beside the draft's), the planner on the
#                                              # GPU, then the bench with the plan's policies and the transformers peers,
#                                              # and a plan and a bench at top-k 50
# It runs with the machine's own python3 (a CUDA torch) and PYTHONPATH=. instead of scripts/setup.sh, which
# needs a package registry. Wheels in .whl/ (nltk; kenlm has none, its tests skip) are installed first.
# Logs and JSON go to $LOGS (default: $OUT when it is set, else gpu-logs/).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stage="${1:?usage: bash scripts/gpu_check.sh tests|train|decode|brief|compiled|plan [RUN]}"
run="${2:-runs/gpu}"
logs="${LOGS:-${OUT:-gpu-logs}}"
device="${DEVICE:-cuda}"  # DEVICE=cpu tries a stage's commands on a machine without a GPU
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
    [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=".:/tmp/site"
else
    export PYTHONPATH="."
fi
# a command, not a function: step runs it under timeout, which cannot run shell functions
launch=(python3 -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no)
failed=0
step() {  # step NAME COMMAND...: run it, log it, keep going on failure
    local name="$1"; shift
    local t0=$SECONDS
    echo "== $name"
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    echo "   rc $rc, $((SECONDS - t0)) s; last lines:"; tail -n 4 "$logs/$name.log" | sed 's/^/   | /'
    [ $rc -eq 0 ] || failed=1
}
machine() {  # what the checks ran on
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
}
# the paper's regime at a size that trains in minutes: a GPT-2-small-sized oracle (12 x 768), a 4 x 256 draft, the trigram
train_oracle() {  # train_oracle STEPS
    step oracle "${launch[@]}" train/finetune_oracle.py --preset cpu --data "$run/data" --out "$run/oracle" --overwrite \
        --n-layer 12 --n-head 12 --n-embd 768 --batch-size 16 --grad-accum 1 --max-steps "$1" --learning-rate 6e-4 \
        --eval-every 500 --save-every 500
}
train_draft() {  # train_draft STEPS
    step draft "${launch[@]}" train/distill_draft.py --preset cpu --teacher "$run/oracle" --data "$run/data" --out "$run/draft" \
        --overwrite --n-layer 4 --n-head 4 --n-embd 256 --max-steps "$1" --kd-loss tv --teacher-windows 0.5 \
        --teacher-prefixes prompts
}
build_trigram() {
    step trigram python3 ngram/build_katz.py --data "$run/data" --out "$run/ngram" --overwrite
}
train_models() {  # train_models ORACLE_STEPS DRAFT_STEPS
    train_oracle "$1"
    train_draft "$2"
    build_trigram
}

case "$stage" in
tests)
    machine
    # one thread per worker: tiny models, and it leaves cores to a training beside it
    OMP_NUM_THREADS=1 step pytest python3 -m pytest -q -n 8 -p no:cacheprovider
    grep -E "passed|failed|error" "$logs/pytest.log" | tail -n 3
    ;;
train)
    train_models 1500 600
    cat "$run/oracle/metrics.json" "$run/draft/metrics.json" > "$logs/metrics.json" 2>/dev/null
    ;;
decode)
    methods=speculative,tree,staged,ngram,lookup
    for dtype in float32 bfloat16; do
        step "agreement-$dtype" python3 -m decode.agreement --run "$run" --device "$device" --dtype "$dtype" --limit 10 \
            --max-new-tokens 128 --methods "$methods" --no-plan --out "$logs/agreement-$dtype.json" --overwrite
    done
    # without CUDA graphs (decode.models.cuda_graphs, the default on a GPU): the same outputs, then their speed below
    step agreement-no-graphs python3 -m decode.agreement --run "$run" --device "$device" --dtype float32 --limit 10 \
        --max-new-tokens 128 --methods "$methods" --no-plan --no-cuda-graphs --out "$logs/agreement-no-graphs.json" \
        --overwrite
    for method in baseline ${methods//,/ }; do
        step "sample-$method" python3 -m decode.run --run "$run" --device "$device" --dtype bfloat16 --method "$method" \
            --limit 4 --max-new-tokens 64 --temperature 1 --top-k 50 --seed 1 --no-plan
    done
    step engine python3 -m decode.bench_engine --model "$run/oracle" --prompts "$run/prompts.jsonl" --device "$device" \
        --dtype bfloat16 --out "$logs/engine.json" --overwrite
    for variant in "" --no-cuda-graphs "--draft-vocab 4096"; do  # the shortlist: a half-size output layer for the draft
        step "profile${variant// /}" python3 -m decode.profile_step --run "$run" --device "$device" --dtype bfloat16 \
            --method staged --limit 4 --max-new-tokens 128 --no-plan $variant
    done
    # screening every policy outlasts one command (129 policies at ~4 s each): a smaller search
    step plan python3 -m decode.plan --run "$run" --device "$device" --dtype bfloat16 --calibration 8 --screen 2 \
        --max-budget 32 --project-oracle gpt2-large --overwrite
    cp "$run/plan.json" "$logs/plan.json" 2>/dev/null
    # 8 prompts: with the transformers peers, 20 outlast the step's 300 s on an H100
    step bench python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 --limit 8 --max-new-tokens 128 \
        --methods baseline,speculative,tree,staged,staged-paper,ngram,lookup,hf-generate,hf-assisted,hf-lookup \
        --out "$logs/bench.json" --plot "$logs/bench.png" --overwrite
    step bench-no-graphs python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 --limit 8 --max-new-tokens 128 \
        --methods baseline,speculative,tree,staged,staged-paper,ngram,lookup --no-cuda-graphs --out "$logs/bench-no-graphs.json" \
        --overwrite
    ;;
brief)
    # RUN/data and RUN/tokenizer prepared; LLAMA_RUN (default runs/quick-llama): a trained Llama-family oracle and
    # draft on the same tokenizer and data, whose trigram is RUN's
    llama="${3:-runs/quick-llama}"
    machine
    # on the CPU beside the training: the CUDA-only tests, then every file that mentions CUDA (one thread per
    # worker), and the trigram
    ( OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_cuda_graphs.py \
        tests/test_coupled.py tests/test_llama_engine.py > "$logs/pytest-cuda.log" 2>&1
      OMP_NUM_THREADS=1 timeout 300 python3 -m pytest -q -n 6 -p no:cacheprovider $(grep -l cuda tests/test_*.py) \
        > "$logs/pytest.log" 2>&1 ) &
    tests=$!
    ( STEP_TIMEOUT=200 build_trigram > "$logs/trigram-step.log"; exit $failed ) &
    trigram=$!
    STEP_TIMEOUT=150 train_oracle 800
    wait $trigram || failed=1; cat "$logs/trigram-step.log"
    [ -e "$llama/ngram" ] || ln -s "$(realpath "$run/ngram")" "$llama/ngram"
    # the Llama pair's exactness on CUDA, with and without graphs, beside the draft's training
    methods=speculative,tree,staged,lookup
    ( STEP_TIMEOUT=150 step llama-agreement python3 -m decode.agreement --run "$llama" --device "$device" \
        --dtype float32 --limit 6 --max-new-tokens 96 --no-plan --methods "$methods" \
        --out "$logs/llama-agreement.json" --overwrite
      STEP_TIMEOUT=150 step llama-agreement-no-graphs python3 -m decode.agreement --run "$llama" --device "$device" \
        --dtype bfloat16 --limit 6 --max-new-tokens 96 --no-plan --methods "$methods" --no-cuda-graphs \
        --out "$logs/llama-agreement-no-graphs.json" --overwrite; exit $failed ) > "$logs/llama-agreement-steps.log" &
    agreement=$!
    STEP_TIMEOUT=120 train_draft 300
    wait $agreement || failed=1; cat "$logs/llama-agreement-steps.log"
    # speed, the GPU to itself: the Llama pair, then what decoding takes without a plan against plain decoding
    STEP_TIMEOUT=100 step llama-bench python3 -m decode.bench --run "$llama" --device "$device" --dtype bfloat16 \
        --no-plan --limit 10 --max-new-tokens 128 --methods "baseline,$methods,hf-generate" \
        --out "$logs/llama-greedy.json" --overwrite
    STEP_TIMEOUT=120 step bench python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 --no-plan \
        --limit 10 --max-new-tokens 128 --methods "baseline,$methods,hf-generate,hf-assisted,hf-lookup" \
        --out "$logs/unplanned-greedy.json" --overwrite
    STEP_TIMEOUT=100 step bench-topk python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 \
        --no-plan --limit 5 --max-new-tokens 128 --temperature 1 --top-k 50 --seed 1 --methods "baseline,$methods" \
        --out "$logs/unplanned-topk.json" --overwrite
    wait $tests
    for log in pytest-cuda pytest; do echo "== $log"; tail -n 3 "$logs/$log.log" | sed 's/^/   | /'; done
    for log in pytest-cuda pytest; do tail -n 1 "$logs/$log.log" | grep -qE "failed|error|no tests" && failed=1; done
    ;;
compiled)
    # RUN: a trained GPT-2 pair (its trigram built); LLAMA_RUN: a Llama-family pair on RUN's tokenizer
    llama="${3:-runs/quick-llama}"
    machine
    STEP_TIMEOUT=150 step pytest-compiled python3 -m pytest -q -p no:cacheprovider tests/test_compiled_layers.py
    step shaped python3 -m decode.shaped --shape qwen2.5-0.5b --tokenizer "$run/tokenizer" --out "$logs/qwen2.5-0.5b-shaped" \
        --overwrite
    STEP_TIMEOUT=200 step engine-compiled python3 -m decode.bench_engine --model "$logs/qwen2.5-0.5b-shaped" \
        --prompts "$run/prompts.jsonl" --device "$device" --dtype bfloat16 --limit 2 --skip-large --compile-layers \
        --out "$logs/qwen2.5-0.5b-engine.json" --overwrite
    rm -rf "$logs/qwen2.5-0.5b-shaped"
    [ -e "$llama/ngram" ] || ln -s "$(realpath "$run/ngram")" "$llama/ngram"
    for pair in "$run" "$llama"; do
        for variant in "" --compile-layers; do
            STEP_TIMEOUT=150 step "bench-$(basename "$pair")${variant}" python3 -m decode.bench --run "$pair" --device "$device" \
                --dtype bfloat16 --no-plan --limit 10 --max-new-tokens 128 --methods baseline,speculative,tree,staged,lookup \
                $variant --out "$logs/$(basename "$pair")${variant}-greedy.json" --overwrite
        done
    done
    ;;
plan)
    machine
    ( OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_coupled.py \
        > "$logs/pytest-cuda.log" 2>&1 ) &
    # accelerate launch with --compile (inductor): a short oracle training beside the draft's, before the planner
    # measures anything
    ( timeout 240 "${launch[@]}" train/finetune_oracle.py --preset cpu --data "$run/data" --out "$run/oracle-compiled" \
        --overwrite --n-layer 12 --n-head 12 --n-embd 768 --batch-size 16 --grad-accum 1 --max-steps 300 \
        --eval-every 300 --save-every 300 --compile > "$logs/compile.log" 2>&1; echo "rc $?" >> "$logs/compile.log" ) &
    STEP_TIMEOUT=150 train_models 800 300
    wait
    for log in pytest-cuda compile; do echo "== $log"; tail -n 3 "$logs/$log.log" | sed 's/^/   | /'; done
    # a smaller search than decode's: 129 policies at ~4 s each outlast a command
    STEP_TIMEOUT=200 step plan python3 -m decode.plan --run "$run" --device "$device" --dtype bfloat16 --calibration 6 \
        --screen 2 --max-budget 32 --project-oracle gpt2-large --overwrite
    cp "$run/plan.json" "$logs/plan.json" 2>/dev/null
    STEP_TIMEOUT=150 step bench python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 --limit 10 \
        --max-new-tokens 128 --methods baseline,speculative,tree,staged,lookup,hf-generate,hf-assisted,hf-lookup \
        --out "$logs/bench.json" --overwrite
    # the bench at top-k 50 with a plan made for that setting (screening decodes for real: ~2 policies a second)
    STEP_TIMEOUT=220 step plan-topk python3 -m decode.plan --run "$run" --device "$device" --dtype bfloat16 --calibration 6 \
        --screen 2 --max-budget 32 --temperature 1 --top-k 50 --overwrite
    STEP_TIMEOUT=100 step bench-topk python3 -m decode.bench --run "$run" --device "$device" --dtype bfloat16 --limit 6 \
        --max-new-tokens 128 --temperature 1 --top-k 50 --seed 1 --methods baseline,speculative,tree,staged,lookup \
        --out "$logs/bench-topk.json" --overwrite
    ;;
*)
    echo "error: unknown stage $stage; use tests, train, decode, brief, compiled or plan" >&2; exit 2 ;;
esac
exit $failed
