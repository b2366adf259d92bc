#!/usr/bin/env bash
# The GPU check in one command, sized for one lent device run: at most BUDGET_S seconds (default 540,
# under the device tool's 10 minutes a command, its start-up aside). The steps run in order of what
# matters most; each writes its results to RESULTS (default gpu_results/) as it completes, and a step
# whose estimate no longer fits the time left is skipped (named on stderr), so a run cut short keeps
# what it measured. Estimates at real size on an H200 (not yet measured: no GPU has been lent):
#   1 tests      the quick decoding tests on cuda (WFD_TEST_DEVICE=cuda: eager decoding on SDPA's fused
#                kernels, CUDA graphs taken, static KV buffers kept, compiled == AR)         ~180 s
#   2 huginn     huginn-0125 config, random weights, bf16, emulated acceptance 0.94, AR and WFD,
#                1 prompt of 8 tokens, 128 new tokens, eager (weights built on the GPU)      ~60 s
#   3 ouro       the same for Ouro-2.6B at acceptance 0.92                                   ~60 s
#   4 huginn-c   step 2 compiled: 6 graphs (P, R, read at widths 1 and 8), then timed        ~200 s
#   5 ouro-c     step 3 compiled: 4 graphs, two of them the 48-layer R call                  ~300 s
#   6 batch      the batch sweep (--batch-sizes 1,2,4,8) on huginn-0125, compiled, 8 prompts ~300 s
#   7 parcae     parcae-1.3b, eager, acceptance 0.9                                          ~60 s
# A compiled step fails when its timed runs compiled any graph (bench.py's graphs_compiled).
#   scripts/gpu_check.sh               the steps above (STEPS="huginn ouro": those alone)
#   scripts/gpu_check.sh --smoke       the bench steps on the CPU on the tiny golden configs, in
#                                      seconds (the compiled one included): tests/test_bench.py
#   PYTHON=/path/to/python             the interpreter (default: python)
#   PAPER_MODELS="DIR ..."             last, bench.py --paper --per-category 1 on those checkpoints
set -uo pipefail
cd "$(dirname "$0")/.."  # the project
PY=${PYTHON:-python}
RESULTS=${RESULTS:-gpu_results}
start=$SECONDS failed=0
if [ "${1:-}" = --smoke ]; then
    BUDGET_S=${BUDGET_S:-100000}
    device=cpu new=6 huginn=tests/testdata/huginn_A/config.json ouro=tests/testdata/ouro_A/config.json
    parcae=tests/testdata/parcae_A/config.json batches=1,2 steps=${STEPS:-huginn ouro huginn-c batch parcae}
else
    device=cuda new=128 huginn=configs/huginn-0125.json ouro=configs/ouro-2.6b.json
    parcae=configs/parcae-1.3b.json batches=1,2,4,8 steps=${STEPS:-tests huginn ouro huginn-c ouro-c batch parcae}
    BUDGET_S=${BUDGET_S:-540}
fi
mkdir -p "$RESULTS"

# step NAME ESTIMATE_S COMMAND...: runs COMMAND into RESULTS/NAME.txt if its estimate fits the time left;
# status 0 when it ran and passed
step() {
    local name=$1 estimate=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - start)))
    if [ "$left" -lt "$estimate" ]; then
        echo "gpu_check: skipping $name: ${left} s left, it needs about ${estimate} s" >&2
        echo "$name: skipped" >> "$RESULTS/steps.txt"
        return 1
    fi
    echo "gpu_check: $name (about ${estimate} s, ${left} s left)" >&2
    local t0=$SECONDS rc
    timeout "$left" "$@" > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
    rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" >> "$RESULTS/steps.txt"
    cat "$RESULTS/$name.txt"
    if [ $rc -ne 0 ]; then
        echo "gpu_check: $name failed (exit $rc): $RESULTS/$name.err" >&2
        tail -n 5 "$RESULTS/$name.err" >&2
        failed=1
        return 1
    fi
}

# bench NAME ESTIMATE_S CONFIG ACCEPTANCE [FLAGS...]: AR against WFD on a real config, random weights
bench() {
    local name=$1 estimate=$2 config=$3 acceptance=$4
    shift 4
    step "$name" "$estimate" "$PY" bench.py --random-weights "$config" --acceptance "$acceptance" --device $device \
        --dtype bfloat16 --num-prompts 1 --prompt-len 8 --max-new-tokens $new --warmup 2 --methods ar,wfd \
        --out "$RESULTS/$name" "$@"
}

# fails when a timed run of a compiled step compiled a graph (its answers' stats)
NO_COMPILING='
import glob, json, sys
answers = [json.loads(line) for path in glob.glob(sys.argv[1] + "/*.jsonl") for line in open(path)]
compiled = sum(a["stats"]["graphs_compiled"] for a in answers)
print(f"graphs compiled during the timed runs: {compiled} over {len(answers)} answers")
sys.exit(compiled != 0 or not answers)'

for s in $steps; do
    case $s in
        tests) step tests 180 env WFD_TEST_DEVICE=cuda "$PY" -m pytest -q -x test_wfd.py \
                   tests/test_sampling.py tests/test_compile.py tests/test_families.py ;;
        huginn) bench huginn 60 "$huginn" 0.94 ;;
        ouro) bench ouro 60 "$ouro" 0.92 ;;
        huginn-c | ouro-c)
            config=$([ $s = huginn-c ] && echo "$huginn" || echo "$ouro")
            acceptance=$([ $s = huginn-c ] && echo 0.94 || echo 0.92)
            bench $s $([ $s = huginn-c ] && echo 200 || echo 300) "$config" $acceptance --compile \
                && step $s-check 5 "$PY" -c "$NO_COMPILING" "$RESULTS/$s" ;;
        # the paper's batch curve: the same prompts (as many as the largest batch) through more and more slots
        batch) bench batch 300 "$huginn" 0.94 --compile --num-prompts "${batches##*,}" --max-new-tokens $((new / 2)) \
                   --batch-sizes $batches ;;
        parcae) bench parcae 60 "$parcae" 0.9 ;;
        *) echo "gpu_check: unknown step $s" >&2; failed=1 ;;
    esac
done
# the paper's Spec-Bench protocol (bench.py --paper), one prompt per category, on real checkpoints
# named by folder (a GPU machine may reach no hub): PAPER_MODELS="path/Ouro-2.6B path/huginn-0125"
for model in ${PAPER_MODELS:-}; do
    step "paper-$(basename "$model")" 120 "$PY" bench.py --paper --model "$model" --device $device --per-category 1 --out ''
done
echo "gpu_check: done in $((SECONDS - start)) s; results in $RESULTS/" >&2
exit $failed
