#!/usr/bin/env bash
# The GPU check in one command, sized for one lent device run: 15 minutes of device time in all,
# the machine's start included, and at most 10 minutes a command, so this script keeps within
# BUDGET_S seconds (default 540). The steps run in order of what a GPU run must tell first, each
# its output to RESULTS (default: $OUT where it is set, the folder a device run hands back, else
# gpu_results/) and to stdout as it comes (python unbuffered), and its line in RESULTS/steps.txt
# as it ends (its status and seconds). A step whose estimate no longer fits the time left is
# skipped (named on stderr), and each is killed at the end of the budget (TIMEOUT_S: sooner), so a
# run cut short keeps what it saw: the test steps run pytest -v, each case's verdict written as it
# ends, and a test step killed names the cases it was running (scripts/gpu_check_cases.py). It
# installs nothing: a lent machine reaches no package registry. Random weights are drawn on the
# GPU. Estimates on an H200 (cuda-path and tests measured there, the rest not yet), compiling
# included. With pytest-xdist installed (the lent machines have it) the two test steps run their
# tests in 8 processes:
#   env       the device, torch and Triton versions, free memory, pytest-xdist or not        ~20 s
#   cuda-path the imitation's matrix for real (tests/test_cuda_path.py on cuda: CUDA graphs through
#             compiling.replay, pinned staging in a ring of 2 with CUDA events, the CUDA-graph
#             counters): every family equal to compiled AR and eager AR's tokens, in each of greedy,
#             sampled, second proposal, batched with refill and shared KV (without xdist: the quick
#             suite's cases, each family once and each case once); and decoding after the prefill
#             under torch.cuda.set_sync_debug_mode("error") but in the tick's one transfer, eager
#             and compiled (not yet run on a GPU: the estimate is from before it)        ~115 s
#   tests     the other cuda tests that matter: static KV buffers kept, CUDA graphs
#             taken, one blocking transfer per tick, compiled WFD == compiled AR across every key
#             bucket, a row's bits independent of its lane (what the second proposal rests
#             on), eager WFD == AR on SDPA's fused kernels (TESTS="ID ...": those instead)  ~90 s
#   huginn-c  huginn-0125 config, bf16, emulated acceptance 0.94, AR and WFD, 64 new tokens,
#             compiled (CUDA graphs; fails when a timed run compiled or re-recorded a graph) ~110 s
#   ouro-c    the same for Ouro-2.6B at acceptance 0.92 (its 48-layer R graph)            ~130 s
#   huginn    huginn-c eager (every R call 634 kernels: the dispatcher's speed), ~30 s: STEPS only
#   ouro      ouro-c eager (6,941 per R call), ~35 s: STEPS only
#   batch     the batch sweep (--batch-sizes 1,4) on huginn-0125, compiled, 32 tokens     ~40 s
#   parcae    parcae-1.3b, compiled, acceptance 0.9                                        ~20 s
#   paper     bench.py --paper, compiled, one prompt per category, 64 tokens, its answers kept, on
#             the checkpoints in PAPER_MODELS="DIR ..." (a GPU machine may reach no hub)
#             ~90 s each (none without PAPER_MODELS)
#   scripts/gpu_check.sh               the steps above (STEPS="huginn-c ouro-c": those alone)
#   scripts/gpu_check.sh --smoke       the bench steps small on the CPU, in seconds, and a check
#                                      that the estimates above fit the budget (tests/test_bench.py)
#   PYTHON=/path/to/python             the interpreter (default: python)
set -uo pipefail
cd "$(dirname "$0")/.."  # the project
export PYTHONUNBUFFERED=1  # each line in the results as it is printed, even from a step killed
PY=${PYTHON:-python}
RESULTS=${RESULTS:-${OUT:-gpu_results}}
ALL="env cuda-path tests huginn-c ouro-c batch parcae paper"
declare -A ESTIMATE=([env]=20 [cuda-path]=115 [tests]=90 [huginn-c]=110 [ouro-c]=130 [batch]=40
                     [parcae]=20 [paper]=0 [huginn]=30 [ouro]=35)  # the last two: by STEPS only
start=$SECONDS failed=0
GPU_BUDGET_S=540
if [ "${1:-}" = --smoke ]; then
    total=0
    for s in $ALL; do total=$((total + ESTIMATE[$s])); done
    if [ "$total" -gt "$GPU_BUDGET_S" ]; then
        echo "gpu_check: the steps' estimates sum to $total s, over the budget of $GPU_BUDGET_S s" >&2
        exit 1
    fi
    echo "gpu_check: the steps' estimates sum to $total s of $GPU_BUDGET_S s" >&2
    BUDGET_S=${BUDGET_S:-100000}
    device=cpu new=6 huginn=tests/testdata/huginn_A/config.json ouro=tests/testdata/ouro_A/config.json
    parcae=tests/testdata/parcae_A/config.json batches=1,2 tests="tests/test_compile.py::test_compiled_schedules_compile_nothing_and_equal_compiled_ar"
    steps=${STEPS:-env huginn-c ouro-c huginn ouro batch parcae paper}
else
    BUDGET_S=${BUDGET_S:-$GPU_BUDGET_S}
    device=cuda new=64 huginn=configs/huginn-0125.json ouro=configs/ouro-2.6b.json
    parcae=configs/parcae-1.3b.json batches=1,4
    tests="tests/test_compile.py::test_static_buffers_stay_and_cuda_graphs_are_taken
           tests/test_compile.py::test_compiled_wfd_equals_compiled_ar_across_every_key_bucket
           tests/test_families.py::test_one_blocking_transfer_per_tick_on_every_family
           tests/test_siblings.py::test_a_rows_bits_do_not_depend_on_its_lane
           tests/test_engine.py::test_eager_decoding_runs_on_fused_attention_kernels_alone
           test_wfd.py::test_every_schedule_gives_ar_at_every_draft_depth
           test_wfd.py::test_the_engine_gives_the_references_tokens"
    steps=${STEPS:-$ALL}
fi
tests=${TESTS:-$tests}
mkdir -p "$RESULTS"

# killed NAME LIMIT: the line a step killed by its timeout ends with; for a test step, the cases
# it had started and not ended (RESULTS/NAME.cases)
killed() {
    local cases="$RESULTS/$1.cases" running
    if [ -n "$(tail -c 1 "$RESULTS/$1.txt")" ]; then
        echo  # cut mid-line (pytest -v writes a case's name as it starts): that line ends here
    fi
    if [ ! -f "$cases" ]; then
        echo "gpu_check: $1 killed by its timeout ($2 s)"
        return
    fi
    running=$(grep -Fvxf <(sed -n 's/^end //p' "$cases") <(sed -n 's/^start //p' "$cases") |
              paste -sd ' ')
    echo "gpu_check: $1 killed by its timeout ($2 s) while running: ${running:-no case}"
}

# step NAME ESTIMATE_S COMMAND...: runs COMMAND if its estimate fits the time left, its stdout
# into RESULTS/NAME.txt and stdout, its stderr into RESULTS/NAME.err and stderr, each line as it
# comes; killed at the end of the budget (or after TIMEOUT_S). Status 0 when it ran and passed
step() {
    local name=$1 estimate=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - start)))
    if [ "$left" -lt "$estimate" ]; then
        echo "gpu_check: skipping $name: ${left} s left, it needs about ${estimate} s" >&2
        echo "$name: skipped" >> "$RESULTS/steps.txt"
        return 1
    fi
    local limit=$((left - 5))  # and 5 s more for a step that ignores the TERM before its KILL
    if [ -n "${TIMEOUT_S:-}" ] && [ "$TIMEOUT_S" -lt "$limit" ]; then
        limit=$TIMEOUT_S
    fi
    echo "gpu_check: $name (about ${estimate} s, ${left} s left)" >&2
    local t0=$SECONDS rc
    timeout -k 5 "$limit" "$@" 2> >(tee "$RESULTS/$name.err" >&2) | tee "$RESULTS/$name.txt"
    rc=${PIPESTATUS[0]}
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "$name: killed by its timeout after $((SECONDS - t0)) s" >> "$RESULTS/steps.txt"
        killed "$name" "$limit" | tee -a "$RESULTS/$name.txt"
    else
        echo "$name: exit $rc in $((SECONDS - t0)) s" >> "$RESULTS/steps.txt"
    fi
    if [ $rc -ne 0 ]; then
        echo "gpu_check: $name failed (exit $rc): $RESULTS/$name.err" >&2
        failed=1
        return 1
    fi
}

# pytest_step NAME ARGS...: pytest on the device, -v: each case's verdict in RESULTS/NAME.txt as it
# ends, and its start and end in RESULTS/NAME.cases (the plugin imported from scripts/ by a name
# of its own: a package named scripts installed on the machine would hide scripts.NAME)
pytest_step() {
    local name=$1 path="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
    shift
    rm -f "$RESULTS/$name.cases"
    step "$name" "${ESTIMATE[$name]}" env WFD_TEST_DEVICE=$device \
        GPU_CHECK_CASES="$RESULTS/$name.cases" PYTHONPATH="$path" "$PY" -m pytest -v \
        -p gpu_check_cases "$@"
}

# the machine as the run found it, printed first
ENVIRONMENT='
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    import triton
    print(f"Triton {triton.__version__}")
except ImportError:
    print("Triton not installed")
print("pytest-xdist", "installed" if importlib.util.find_spec("xdist") else "not installed")
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    print(f"cuda:{i} {torch.cuda.get_device_name(i)}: {free / 2**30:.1f} GiB free of "
          f"{total / 2**30:.1f}")
if not torch.cuda.is_available():
    print("no CUDA device")'

# bench NAME CONFIG ACCEPTANCE [FLAGS...]: AR against WFD on a real config, random weights
bench() {
    local name=$1 config=$2 acceptance=$3
    shift 3
    step "$name" "${ESTIMATE[$name]}" "$PY" bench.py --random-weights "$config" --acceptance "$acceptance" --device $device \
        --dtype bfloat16 --num-prompts 1 --prompt-len 8 --max-new-tokens $new --warmup 2 --methods ar,wfd \
        --out "$RESULTS/$name" "$@"
}

# fails when a timed run of a compiled step compiled a graph or re-recorded or skipped a CUDA graph
# (its answers' stats)
NOTHING_COMPILED='
import glob, json, sys
answers = [json.loads(line) for path in glob.glob(sys.argv[1] + "/*.jsonl") for line in open(path)]
counts = {k: sum(a["stats"][k] for a in answers)
          for k in ("graphs_compiled", "cuda_graphs_rerecorded", "cuda_graphs_skipped")}
print(f"during the timed runs of {len(answers)} answers: {counts}")
sys.exit(any(counts.values()) or not answers)'

compiled() {  # compiled NAME CONFIG ACCEPTANCE [FLAGS...]: bench, compiled, then its check
    local name=$1
    bench "$@" --compile && step "$name-check" 5 "$PY" -c "$NOTHING_COMPILED" "$RESULTS/$name"
}

# the test steps' flags: the whole matrix in 8 processes where pytest-xdist is installed
parallel=""
case " $steps " in
    *" cuda-path "*|*" tests "*) "$PY" -c "import xdist" 2>/dev/null && parallel="--runslow -n 8" ;;
esac
for s in $steps; do
    case $s in
        env) step env "${ESTIMATE[env]}" "$PY" -c "$ENVIRONMENT" ;;
        # the imitation switched off: its cases on the GPU, all of them in 8 processes where
        # pytest-xdist is installed, else the quick suite's
        # shellcheck disable=SC2086  # the flags and test ids are words
        cuda-path) pytest_step cuda-path $parallel tests/test_cuda_path.py ;;
        # shellcheck disable=SC2086
        tests) pytest_step tests --runslow ${parallel:+-n 8} $tests ;;
        huginn-c) compiled huginn-c "$huginn" 0.94 ;;
        ouro-c) compiled ouro-c "$ouro" 0.92 ;;
        huginn) bench huginn "$huginn" 0.94 --eager ;;
        ouro) bench ouro "$ouro" 0.92 --eager ;;
        # the paper's batch curve: the same prompts (as many as the largest batch) through more slots
        batch) bench batch "$huginn" 0.94 --compile --num-prompts "${batches##*,}" \
                   --max-new-tokens $((new / 2)) --batch-sizes $batches ;;
        parcae) compiled parcae "$parcae" 0.9 ;;
        paper)  # the paper's Spec-Bench protocol on real checkpoints, named by folder
            for model in ${PAPER_MODELS:-}; do
                step "paper-$(basename "$model")" 90 "$PY" bench.py --paper --model "$model" \
                    --device $device --compile --per-category 1 --max-new-tokens $new \
                    --out "$RESULTS/paper-$(basename "$model")"
            done ;;
        *) echo "gpu_check: unknown step $s" >&2; failed=1 ;;
    esac
done
echo "gpu_check: done in $((SECONDS - start)) s; results in $RESULTS/" >&2
exit $failed
