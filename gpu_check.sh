#!/usr/bin/env bash
# The GPU checks (README, "Compiled decoding"), one command, about 5 minutes on an H200 (and the batch
# sweep's compiles on top):
#   ./gpu_check.sh          the decoding tests on cuda (among them: eager decoding on SDPA's flash and
#                           memory-efficient kernels alone; no CUDA graph skipped by inductor; static KV
#                           buffers at the same addresses across generations), then bench.py --compile
#                           on the real huginn-0125, Ouro-2.6B and parcae-1.3b configs (random weights,
#                           bfloat16, emulated acceptance 0.94 / 0.92 / 0.9, 256 new tokens): per config,
#                           the table, and AR's tok/s against the bandwidth bound; then the batch sweep
#                           (bench.py --batch-sizes 1,2,4,8,16: 16 prompts, 128 new tokens, compiled at
#                           each batch size) on the huginn-0125 and Ouro-2.6B configs: WFD's speedup over
#                           AR at each batch size, every output identical to AR's through the same slots
#   ./gpu_check.sh --smoke  the same bench.py commands on the CPU on the tiny golden configs, not compiled
#                           (compiling takes a minute on a small CPU), the batch sweep at batch sizes 1, 2
#                           and 4, in seconds: test_bench.py runs it
#   PAPER_MODELS="DIR ..." ./gpu_check.sh   also bench.py --paper on those checkpoint folders, --per-category 1
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = --smoke ]; then
    device=cpu new=4 compile= huginn=testdata/huginn_A/config.json ouro=testdata/ouro_A/config.json \
        parcae=testdata/parcae_A/config.json batches=1,2,4 batch_new=4
else
    device=cuda new=256 compile=--compile huginn=configs/huginn-0125.json ouro=configs/ouro-2.6b.json \
        parcae=configs/parcae-1.3b.json batches=1,2,4,8,16 batch_new=128
    WFD_TEST_DEVICE=cuda python -m pytest -q test_wfd.py test_sampling.py test_compile.py
fi
for run in "$huginn 0.94" "$ouro 0.92" "$parcae 0.9"; do
    set -- $run
    python bench.py --random-weights "$1" --acceptance "$2" --device $device --dtype bfloat16 $compile \
        --num-prompts 1 --prompt-len 8 --max-new-tokens $new --warmup 2 --methods ar,wfd --out ''
done
# the paper's batch curve: the same prompts (as many as the largest batch) through more and more slots
for run in "$huginn 0.94" "$ouro 0.92"; do
    set -- $run
    python bench.py --random-weights "$1" --acceptance "$2" --device $device --dtype bfloat16 $compile \
        --num-prompts "${batches##*,}" --prompt-len 8 --max-new-tokens $batch_new --warmup 2 --methods ar,wfd \
        --batch-sizes $batches --out ''
done
# the paper's Spec-Bench protocol (bench.py --paper), one prompt per category, on the real checkpoints
# named by folder (a GPU machine may reach no hub): PAPER_MODELS="path/Ouro-2.6B path/huginn-0125" ./gpu_check.sh
for model in ${PAPER_MODELS:-}; do
    python bench.py --paper --model "$model" --device $device --per-category 1 --out ''
done
