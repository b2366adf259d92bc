r"""Spec-Bench-style speed comparison of AR, draft-then-verify and the wavefront on one looped LM.

Every prompt is decoded by every method (after a warm-up); each output is checked against AR token
for token; a markdown table per category and overall is printed, and one JSONL of answers per method
is written in Spec-Bench's answer format.

    python bench.py                                       # demo model, held-out stdlib prompts
    python bench.py --model PATH --questions data/specbench/question.jsonl --per-category 10
    python bench.py --random-weights configs/huginn-0125.json --acceptance 0.94 --max-new-tokens 8
    python bench.py --paper --model ByteDance/Ouro-2.6B --device cuda         # the paper's protocol
    python bench.py --sweep acceptance --plot acc.png     # a row per point, sweep-acceptance.json
    python bench.py --plot-from bench_out/sweep-acceptance.json --plot acc.png  # saved points again
    python bench.py --batch-size 4                        # every method, 4 sequences at a time
    python bench.py --random-weights configs/ouro-2.6b.json --acceptance 0.9 --num-prompts 8 \
        --batch-sizes 1,2,4,8

--random-weights builds a model of that config with random weights (real sizes without the real
weights). --acceptance A makes each draft right with probability A, from a seeded Bernoulli stream:
the draft is replaced by AR's token or by a wrong one before it is used, so every call still runs
and the output still equals AR's. Such results are labelled "emulated". --sweep runs every method at
each point of a sweep (emulated acceptance, draft depth k, prompt length) for the paper's figures;
--plot draws one with matplotlib, an optional dependency (cli/figures.py: the table and the figure).
--batch-size B decodes the prompt set through B slots in one batched call per method, a finished
sequence's slot taking the next prompt; --batch-sizes sweeps it.
"""
if __name__ == "__main__":  # Ctrl-C while torch imports: one line and status 130
    from cli import interrupt_quietly
    interrupt_quietly()

import argparse
import json
import math
import os
import random
import re
import shlex
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone

import torch
from tqdm import tqdm

import engine
import models
import wfd
from cli import figures
from cli.answers import Answers, check_out, fingerprint
from cli.args import (DEMO, DTYPES, TOKENIZER_HELP, Parser, add_decoding_args, check_at_least,
                      compiling_line, naming, one_line_errors, resolve_compile, set_threads)
from cli.output import finite, token_match
from cli.prompts import read_questions, random_prompts, specbench_prompts, stdlib_prompts
from formats import checkpoints
from formats.checkpoints import load_tokenizer, read_json
from engine import checks, model_runner
from formats.devices import check_device

# name: (generate's method, kv, width, label, its exact reference: the run whose output it must
# equal). Width "wave" is ceil(T / k), "dtv" draft_len + 1 (README, "Exact in every precision");
# AR, one row per call, is the baseline of the speedups.
METHODS = {
    "ar": ("ar", "full", 1, "AR", "ar"),
    "ar-wave": ("ar", "full", "wave", "AR, wavefront width", "ar-wave"),
    "ar-dtv": ("ar", "full", "dtv", "AR, DtV width", "ar-dtv"),
    "dtv": ("dtv", "full", "dtv", "DtV", "ar-dtv"),
    "wfd": ("wfd", "full", "wave", "WFD", "ar-wave"),
    "ar-shared": ("ar", "shared", "wave", "AR, shared KV", "ar-shared"),
    "wfd-shared": ("wfd", "shared", "wave", "WFD, shared KV", "ar-shared"),
    # the second proposal (--second-depth): its width, and AR through the same calls
    "ar-2": ("ar", "full", "second", "AR, second-proposal width", "ar-2"),
    "wfd-2": ("wfd", "full", "second", "WFD, second proposal", "ar-2"),
    # the reference (wfd.py's loop, eager, greedy, one prompt): its AR is a plain forward, one row
    # per call and one SDPA call per layer, the speed baseline; its tokens are AR's
    "ref-ar": ("ar", "full", 1, "AR, the reference (wfd.py): a plain forward", "ar"),
    "ref-wfd": ("wfd", "full", "wave", "WFD, the reference (wfd.py)", "ref-ar"),
}
REFERENCE = {"ref-ar", "ref-wfd"}  # decoded by wfd.py's loop, not the engine
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
COLUMNS = ["method", "width", "tok/s", "speedup", "decode speedup", "tokens/round", "acceptance",
           "rescues", "R calls/token", "KV MiB", "identical", "AR match"]
LEGEND = """\
- tok/s: mean over prompts of new tokens / time, prefill included (wall clock, or the process's CPU
  time with --clock cpu); speedup: that mean divided by AR's, as Spec-Bench computes it. decode
  speedup: the same, timed from the first token to the last (without the prefill).
- tokens/round: Spec-Bench's mean accepted tokens, tokens committed per token that came from full
  depth rather than from an accepted draft: tokens / (tokens - accepted drafts). For DtV a round is
  one draft-then-verify cycle (its accepted drafts plus the correction or bonus). WFD verifies one
  position per R call and commits one token per verify, so it has no rounds; its "round" is a run of
  accepted drafts between restarts, about 1 / (1 - acceptance). AR: 1.
- acceptance: accepted / verified drafts. rescues (the second proposal): verifies whose token a
  sibling carried, the draft being wrong, over the verified. R calls/token: sequential
  recurrences per token, prefill included. KV MiB: the KV cache allocated, mean over prompts.
- width: rows per P/R/C call. identical: share of prompts whose tokens and logits equal the
  method's exact reference, AR at the same width (shared-KV runs: with the same sharing); 100% is
  required of every method. AR match: share of token positions equal to plain (1-row) AR's, which
  in reduced precision may part from the others at a near tie. graphs compiled (--compile): the
  graphs torch.compile made during the method's timed runs, 0 unless --warmup 0."""

# -- prompts ---------------------------------------------------------------------------------------


# -- one run ---------------------------------------------------------------------------------------

def settings(name, args):
    """engine.generate's settings for one of METHODS."""
    method, kv, width, _, _ = METHODS[name]
    return dict(method=method, kv=kv,
                width=dict(wave=None, second=None, dtv=args.draft_len + 1).get(width, width),
                num_steps=args.steps, draft_steps=args.draft_steps, draft_len=args.draft_len,
                capacity=args.capacity, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, compile=args.compile,
                second_depth=args.second_depth if width == "second" else None)


def draft_emulator(model, prompt, name, args, ref):
    """One prompt's draft hook, and the drafts it let through (position -> the last draft for it,
    the one its verify compares). With args.acceptance, each draft becomes ref's token with that
    probability and a wrong token otherwise (ref: the reference run's tokens), from a stream seeded
    by the prompt and the method: the same draws whether the prompt runs alone or in a batch. With
    args.second_acceptance B too, one uniform u per position decides both depths: the draft is
    right where u < A, the second proposal where u < B, and wrong they carry the same wrong token
    (a deeper read agrees with a shallow one more often than not)."""
    offset, vocab = len(prompt["ids"]), model.args.vocab_size
    rng = random.Random(f"{args.seed}/{prompt['question_id']}/{name}")
    drafts, draws = {}, {}

    def hook(pos, token, depth=None):
        i = pos - offset
        # past ref's EOS: never committed
        if args.acceptance is not None and ref is not None and i < len(ref):
            if args.second_acceptance is None:
                token = (ref[i] if rng.random() < args.acceptance
                         else (ref[i] + rng.randrange(1, vocab)) % vocab)
            else:
                u, wrong = draws.setdefault(pos, (rng.random(), rng.randrange(1, vocab)))
                right = u < (args.acceptance if depth is None else args.second_acceptance)
                token = ref[i] if right else (ref[i] + wrong) % vocab
        drafts[pos] = token
        return token
    return hook, drafts


def record(out, prompt, drafts, times, time_s):
    """One prompt's result: its Generation's figures, its rounds and its speeds. times: the clock at
    each token's commit; time_s: the prompt's time, prefill included. Its logits are kept as the
    digest in its stats (stats["logits_digest"]), so that a run's memory does not grow with
    its prompts."""
    tokens, offset = out.tokens, len(prompt["ids"])
    # a committed token is an accepted draft iff it equals the last draft for its position; each
    # other token (the prefill's, a correction, a bonus) opens a round
    lengths = []
    for i, t in enumerate(tokens):
        if i > 0 and drafts.get(offset + i) == t:
            lengths[-1] += 1
        else:
            lengths.append(1)
    decode = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else float("nan")
    return dict(tokens=tokens, stats=out.stats, accept_lengths=lengths, time_s=time_s,
                tok_s=len(tokens) / time_s, decode_tok_s=decode)


def run(model, prompt, name, args, max_new_tokens, ref=None):
    """Decode one prompt with one method (ref: as draft_emulator's)."""
    hook, drafts = draft_emulator(model, prompt, name, args, ref)
    clock, times = CLOCKS[args.clock], []
    start, on_token = clock(), lambda t: times.append(clock())
    if name in REFERENCE:
        s = settings(name, args)
        out = wfd.generate(model, prompt["ids"], max_new_tokens, method=s["method"],
                           num_steps=args.steps, draft_steps=args.draft_steps,
                           eos_token_id=prompt["eos"], draft_hook=hook, on_token=on_token)
        # what the engine's stats hold besides: its lanes (the reference has none), its digest
        out.stats.update(width="–", rescued=0, graphs_compiled=0, logits_digest=None)
    else:
        out = engine.generate(model, prompt["ids"], max_new_tokens, eos_token_id=prompt["eos"],
                              draft_hook=hook, on_token=on_token, digest_logits=True,
                              **settings(name, args))
    return record(out, prompt, drafts, times, clock() - start)


def run_batch(model, prompts, name, args, max_new_tokens, refs=None, on_result=None):
    """Decode the prompts with one method in one batched call through args.batch_size slots (one
    per prompt when there are fewer: a resumed run's last ones) (refs: each prompt's ref, as
    draft_emulator's). One result per prompt, as run's, timed by the wall
    clock from its prefill to its last token, and each holding the call's id (batch_id) and its time
    by args.clock until the prompt finished (batch_s: the call's time is its last prompt's).
    on_result(i, result) is called as prompt i finishes."""
    hooks = [draft_emulator(model, p, name, args, ref)
             for p, ref in zip(prompts, refs or [None] * len(prompts))]
    clock, times = CLOCKS[args.clock], [[] for _ in prompts]
    # one model, one format: the same for every prompt
    stop = sorted({t for p in prompts for t in p["eos"] or ()})
    recs, batch_id = [None] * len(prompts), uuid.uuid4().hex

    def finish(i, out):
        recs[i] = dict(record(out, prompts[i], hooks[i][1], times[i], out.stats["wall_s"]),
                       batch_id=batch_id, batch_s=clock() - start)
        if on_result:
            on_result(i, recs[i])

    start = clock()
    engine.generate(model, [p["ids"] for p in prompts], max_new_tokens, eos_token_id=stop,
                    batch_size=args.batch_size,
                    draft_hook=lambda i, pos, token: hooks[i][0](pos, token),
                    on_token=lambda i, token: times[i].append(clock()), on_finish=finish,
                    digest_logits=True, **settings(name, args))
    return recs


# -- tables ----------------------------------------------------------------------------------------

def mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(recs):
    """recs: one result per prompt for one method -> the table's figures."""
    st = [r["stats"] for r in recs]
    tokens, accepted = sum(s["tokens"] for s in st), sum(s["accepted"] for s in st)
    rescued, verified = (sum(s[key] for s in st) for key in ("rescued", "verified"))
    verifies = accepted + rescued + sum(s["rejected"] for s in st)
    # a batch's speed is its throughput: every token over the batched calls' time (a resumed run's
    # prompts come from more than one call)
    # per call: its time; the graphs it compiled
    calls, graphs = defaultdict(float), defaultdict(int)
    for j, r in enumerate(recs):
        # a batch's counts grow as its prompts finish: its last is the call's
        call = r.get("batch_id", j)
        calls[call] = max(calls[call], r.get("batch_s", 0.0))
        graphs[call] = max(graphs[call], r["stats"]["graphs_compiled"])
    tok_s = (tokens / sum(calls.values()) if "batch_id" in recs[0]
             else mean([r["tok_s"] for r in recs]))
    return dict(tok_s=tok_s, decode_tok_s=mean([r["decode_tok_s"] for r in recs]),
                per_round=tokens / (tokens - accepted),
                acceptance=accepted / verified if verified else float("nan"),
                rescues=(rescued / verifies if verifies and st[0].get("second_depth")
                         else float("nan")),
                accepts=accepted / verifies if verifies else float("nan"),  # of the verifies
                r_per_token=sum(s["r_calls"] for s in st) / tokens,
                r_per_decoded=(sum(s["r_calls"] - s["num_steps"] for s in st)
                               / max(1, tokens - len(st))),
                kv_mib=mean([s["kv_bytes"] / 2**20 for s in st]),
                branch_kib=mean([s.get("branch_kv_bytes", 0) / 2**10 for s in st]),
                identical=sum(r["identical"] for r in recs) / len(recs),
                ar_match=mean([r["ar_match"] for r in recs]), width=st[0]["width"],
                graphs=sum(graphs.values()))


def table(results, names, ids, compiled=False):
    """Markdown table over the prompts `ids`; speedups against AR on the same prompts. compiled:
    with a last column, the graphs compiled during the timed runs (0 unless the warm-up
    missed some)."""
    figs = {n: summarize([results[n][i] for i in ids]) for n in names}
    ar = figs["ar"]
    fmt = lambda x, f: "–" if math.isnan(x) else format(x, f)
    columns = COLUMNS + ["graphs compiled"] * compiled
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for n, f in figs.items():
        lines.append("| " + " | ".join([
            METHODS[n][3], str(f["width"]), fmt(f["tok_s"], ".2f"),
            fmt(f["tok_s"] / ar["tok_s"], ".2f") + "x",
            fmt(f["decode_tok_s"] / ar["decode_tok_s"], ".2f") + "x", fmt(f["per_round"], ".2f"),
            fmt(f["acceptance"], ".3f"), fmt(f["rescues"], ".3f"), fmt(f["r_per_token"], ".2f"),
            fmt(f["kv_mib"], ".1f"),
            f"{100 * f['identical']:.0f}%", f"{100 * f['ar_match']:.1f}%"]
            + [str(f["graphs"])] * compiled) + " |")
    return "\n".join(lines), figs


def weight_bytes_per_token(model, num_steps):
    """Bytes of weights plain AR reads per token: the looped block (and the adapter) T times, the
    prelude, the coda (and Parcae's C) and the head once, and one embedding row (the norms and
    Parcae's value-embedding rows are too small to count)."""
    nbytes = lambda modules: sum(p.nbytes for m in modules if m is not None for p in m.parameters())
    return (num_steps * nbytes([model.core, model.adapter])
            + nbytes([model.prelude, model.coda, model.coda_in, model.lm_head])
            + model.embed.weight[0].nbytes)


def memory_bandwidth(device, nbytes=2**28):
    """Bytes per second moved by a device-to-device copy of 256 MiB (read and write), the best
    of 5."""
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    y, best = torch.empty_like(x), math.inf
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


# -- sweeps: the paper's figures -------------------------------------------------------------------

# name: (the setting each point sets, a point's type); figures.AXES names them in the table and the
# figure. The batch sweep's points are --batch-sizes.
SWEEPS = {"acceptance": ("acceptance", float), "draft-steps": ("draft_steps", int),
          "length": ("prompt_len", int), "batch": ("batch_size", int),
          "second-depth": ("second_depth", int)}

def machine(device):
    """The name of the GPU that `device` (the model's, with its index) is, or the CPU's model name
    as lscpu prints it."""
    return torch.cuda.get_device_name(device) if figures.on_gpu(device) else cpu_name()


def sweep_points(model, args, prompts=None):
    """The points of args.sweep: --points (the batch sweep's: --batch-sizes), or the defaults
    (acceptance 0.5..1, k over 1..T, prompt lengths 16..128), each checked before anything runs; a
    batch holds at most the prompts given."""
    T = model.num_steps if args.steps is None else args.steps
    k = checks.default_draft_steps(model, args.steps) if args.draft_steps is None else (
        args.draft_steps)
    if args.points is None:
        return dict(acceptance=[0.5, 0.7, 0.8, 0.9, 0.95, 1.0], length=[16, 32, 64, 128],
                    **{"second-depth": list(range(k + 1, T))}).get(args.sweep,
                                                                    list(range(1, T + 1)))
    flag, points = points_flag(args), parse_points(args)
    bounds = dict(acceptance=(0, 1), length=(1, model.args.max_seq_len - 1),
                  batch=(1, len(prompts or ())), **{"second-depth": (k + 1, T - 1)})
    low, high = bounds.get(args.sweep, (1, T))
    bad = [x for x in points if not low <= x <= high]
    if not points or bad:
        raise ValueError(f"{flag} must lie in {low}..{high}"
                         + (" (the prompts)" if args.sweep == "batch" else "")
                         + f", not {bad[0] if bad else args.points!r}")
    return points


def points_flag(args):
    return "--batch-sizes" if args.sweep == "batch" else f"--points for --sweep {args.sweep}"


def parse_points(args):
    """--points (--batch-sizes) as numbers of the sweep's kind, refused before the model loads if
    they are not; sweep_points checks their range against the model."""
    kind = SWEEPS[args.sweep][1]
    try:
        return [kind(x) for x in args.points.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{points_flag(args)} takes comma-separated {kind.__name__}s, "
                         f"not {args.points!r}") from None


def reuse_key(model, name, args, prompts):
    """What a run of an AR method depends on (drafting methods: None, their drafts change with every
    point): its settings, with the width and KV window the draft depth resolves to, and
    the prompts."""
    s = settings(name, args)
    if s["method"] != "ar":
        return None
    width, window = checks.check_args(model, prompts[0]["ids"], args.max_new_tokens, **s)[4:6]
    s.update(width=width, window=window, draft_steps=None, draft_len=None,
             batch_size=args.batch_size)
    return tuple(sorted(s.items())), tuple(tuple(p["ids"]) for p in prompts), args.max_new_tokens


def fix_capacity(args, prompts):
    # one KV shape, so one set of compiled graphs, for every prompt
    if args.compile and args.capacity is None:
        args.capacity = max(len(p["ids"]) for p in prompts) + args.max_new_tokens - 1


def run_sweep(model, model_id, names, args, argv, log, saved=None, save=None):
    """Every point of args.sweep: all methods, AR's runs measured once where the point leaves them
    alone. saved: the points of an earlier run of the same command (--resume), by their x, kept and
    not measured again. save(record) is called as each point ends. Returns the sweep's record (what
    sweep-NAME.json holds); Ctrl-C prints the table of the points that ended, and says where they
    are."""
    param = SWEEPS[args.sweep][0]
    T = model.num_steps if args.steps is None else args.steps
    measured, points = {}, []  # reuse key -> (index of the point that measured it, its results)
    # a batch sweep's prompts are the same at every point: no batch may be larger
    prompts = (load_prompts(model, model_id, args, lambda msg: None)[0] if args.sweep == "batch"
               else None)

    def record(again=None):
        return dict(
            sweep=args.sweep, x_label=figures.AXES[args.sweep][1], ar_again_tok_s=again,
            model=model_id, machine=machine(model.device), device=args.device,
            threads=torch.get_num_threads(), torch=torch.__version__,
            dtype=str(model.dtype).replace("torch.", ""), clock=args.clock,
            command=shlex.join(["python", "bench.py"] + (sys.argv[1:] if argv is None else argv)),
            date=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", T=T,
            draft_len=args.draft_len, emulated_acceptance=args.acceptance, prompts=len(prompts),
            prompt_source=points[0]["prompt_source"], max_new_tokens=args.max_new_tokens,
            decoding=decoding(args), compiled=args.compile, batch_size=args.batch_size,
            shown=[n for n in names if n == "ar" or METHODS[n][4] != n],
            run_id=fingerprint(model_id, args), points=points)

    try:
        for j, x in enumerate(sweep_points(model, args, prompts)):
            a = argparse.Namespace(**vars(args))
            setattr(a, param, x)
            prompts, source = load_prompts(model, model_id, a, log)
            if x in (saved or {}):
                log(f"{figures.sweep_flag(args.sweep)}: point {j + 1}, {param} = {x}, resumed")
                points.append(saved[x])
                continue
            log(f"{figures.sweep_flag(args.sweep)}: point {j + 1}, {param} = {x}")
            # a new width compiles anew; else warm
            a.warmup = args.warmup if j == 0 or args.compile else 0
            points.append(sweep_point(model, names, a, j, x, T, prompts, source, measured, log))
            if save:
                save(record())
        again = None
        if any(p["methods"]["ar"]["measured_at_point"] != j for j, p in enumerate(points)):
            # AR's run served later points: one more run of it shows how far the machine's speed
            # drifted since
            again = summarize(run_all(model, prompts, ["ar"], a, log)[0]["ar"])["tok_s"]
    except KeyboardInterrupt:
        if points:
            print(figures.text(record()))
        kept = (f": the points that finished ({len(points)}) are in {sweep_path(args)}; the same "
                "command with --resume measures the rest" if points and save else "")
        raise KeyboardInterrupt("interrupted" + kept) from None
    return record(again)


def sweep_point(model, names, a, j, x, T, prompts, source, measured, log):
    """Point j of a sweep (x, its settings a): every method, AR's runs taken from `measured` where
    an earlier point ran them with the same settings (and added to it)."""
    fix_capacity(a, prompts)
    keys = {n: reuse_key(model, n, a, prompts) for n in names}
    reused = {n: measured[keys[n]] for n in names if keys[n] in measured}
    results, _ = run_all(model, prompts, names, a, log, {n: r for n, (_, r) in reused.items()})
    for n in names:
        if keys[n] is not None:
            measured.setdefault(keys[n], (j, results[n]))
    figs = {n: summarize(results[n]) for n in names}
    k = checks.default_draft_steps(model, a.steps) if a.draft_steps is None else a.draft_steps
    acc = figs["wfd"]["acceptance"]
    ar = figs["ar"]
    return finite(dict(
        x=x, k=k, prompt_len=mean([len(p["ids"]) for p in prompts]), prompt_source=source,
        acceptance=acc, ideal=figures.ideal_speedup(T, k, acc), methods={n: finite(dict(
            label=METHODS[n][3], width=f["width"], tok_s=f["tok_s"],
            speedup=f["tok_s"] / ar["tok_s"],
            decode_speedup=f["decode_tok_s"] / ar["decode_tok_s"],
            r_calls_per_token=f["r_per_token"],
            r_call_ratio=ar["r_per_token"] / f["r_per_token"], acceptance=f["acceptance"],
            rescues=f["rescues"], tokens_per_round=f["per_round"], kv_mib=f["kv_mib"],
            identical=f["identical"], measured_at_point=reused.get(n, (j,))[0],
            **({} if n != "wfd-2" else dict(r_calls_formula=figures.second_proposal_calls(
                T, k, a.second_depth, f["accepts"], f["rescues"]))),
        )) for n, f in figs.items()}))


# -- host time per tick ----------------------------------------------------------------------------

@contextmanager
def calls_return_at_once(model, ticks):
    """The model's device work (P, R, C and the choice of tokens) replaced by calls that
    return outputs of the same shapes at once, so that what is left of a generation's time is the
    host's: the schedules, the Decoder, the transfers. ticks: a list that counts the R calls after
    the prefill (each appends one)."""
    saved = model_runner.start_body, model_runner.recur_body, model_runner.read_body
    outputs = {}

    def made(key, make):
        if key not in outputs:
            outputs[key] = make()
        return outputs[key]

    def start_body(model, ids, call, s, e):
        return s, e

    def recur_body(model, s, e, call):
        if call.span:
            ticks.append(1)
        return s

    def read_body(model, s, e, call, sampling, rows=None, salt=None):
        n, lines = len(s) if rows is None else len(rows), 2 if salt is None else 3
        return made(("read", n, lines), lambda: (
            s.new_zeros(n, model.args.vocab_size, dtype=torch.float32),
            torch.stack([s.new_zeros(n, dtype=torch.int64), s.new_ones(n, dtype=torch.int64)]
                        + [s.new_zeros(n, dtype=torch.int64)] * (lines - 2))))
    model_runner.start_body, model_runner.recur_body, model_runner.read_body = (
        start_body, recur_body, read_body)
    try:
        yield
    finally:
        model_runner.start_body, model_runner.recur_body, model_runner.read_body = saved


def host_time(model, args, log):
    """--host-time: the host's microseconds per tick (one R call of the Decoder, with its share of P
    and C calls) of AR and WFD through 1 and 8 slots, the model's calls returning at once, drafts
    right with probability --acceptance (default 0.8). Returns {(method, slots): microseconds}."""
    accept, V = 0.8 if args.acceptance is None else args.acceptance, model.args.vocab_size
    length = args.prompt_len or 16
    n_new = min(args.max_new_tokens, model.args.max_seq_len - length)  # what the context holds
    figures_us = {}
    for slots in (1, 8):
        prompts = [p["ids"] for p in random_prompts(model, slots, length, args.seed)]
        for method in ("ar", "wfd"):
            rng = random.Random(args.seed)
            hook = lambda i, pos, token: token if rng.random() < accept else (token + 1) % V
            ticks = []
            run = lambda n: engine.generate(model, prompts, n, method=method, batch_size=slots,
                                            draft_hook=hook, num_steps=args.steps,
                                            draft_steps=args.draft_steps, compile=False)
            with calls_return_at_once(model, ticks):
                run(4)  # warm
                del ticks[:]
                t0 = time.perf_counter()
                run(n_new)
                figures_us[method, slots] = 1e6 * (time.perf_counter() - t0) / len(ticks)
            log(f"host time: {method} through {slots} slot(s): {len(ticks)} ticks, "
                f"{figures_us[method, slots]:.1f} us each")
    print(f"Host time per tick ({machine(model.device)}, 1 thread, wall clock; the model's calls "
          f"returning at once, {n_new} tokens per prompt, drafts right with "
          f"probability {accept}): " + "; ".join(
              f"{METHODS[m][3]} {figures_us[m, 1]:.1f} us at 1 slot, {figures_us[m, 8]:.1f} us at 8"
              for m in ("ar", "wfd")))
    return figures_us


# -- main ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=DEMO,
                     help="model folder or hub id (default: the demo model)")
    src.add_argument("--random-weights", metavar="CONFIG_JSON",
                     help="a model of this config with random weights")
    p.add_argument("--paper", action="store_true", help="the paper's Spec-Bench protocol for the "
                   "model given (its flags, printed first; any flag given as well wins), and the "
                   "paper's speedups beside ours")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    p.add_argument("--questions", help="Spec-Bench question.jsonl (first turns; needs a tokenizer)")
    p.add_argument("--prompt-format", default="auto", choices=["auto", "raw", "chat"],
                   help="questions as raw text or as one user turn in the model's chat template "
                   "(enable_thinking); auto: chat for the reasoning fine-tunes (a model name "
                   "holding 'Thinking'), raw otherwise, as the paper")
    p.add_argument("--max-prompt-tokens", type=int, help="right-truncate each prompt to N tokens, "
                   "and skip those under 2 tokens (the paper: 512)")
    p.add_argument("--categories", help="comma-separated Spec-Bench categories (default: all)")
    p.add_argument("--per-category", type=int, help="at most this many prompts per category")
    p.add_argument("--limit", type=int, help="run only the first N prompts of the set")
    p.add_argument("--per-file", type=int, default=1,
                   help="held-out stdlib prompts per file (demo model)")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="random-id prompts, for models without a tokenizer")
    p.add_argument("--prompt-len", type=int, help="prompt length in tokens: of each random-id "
                   "prompt (default 16), or of each held-out stdlib prompt (default 48)")
    p.add_argument("--methods", help=f"from {','.join(METHODS)} (default: ar,dtv,wfd,wfd-shared, "
                   "and ref-wfd where greedy and one prompt at a time, without --sweep); AR always "
                   "runs, and so does each method's exact reference (AR at its width)")
    p.add_argument("--acceptance", type=float,
                   help="emulate draft acceptance A (seeded Bernoulli stream)")
    p.add_argument("--second-acceptance", type=float, metavar="B", help="with --acceptance and "
                   "--second-depth: the second proposal right with probability B >= A, coupled "
                   "with the draft (one uniform per position decides both)")
    p.add_argument("--warmup", type=int, default=8, help="tokens of the warm-up run of each method "
                   "(0: none; with --compile at least 2, which it takes to compile)")
    p.add_argument("--capacity", type=int, help="KV cache positions (default: prompt + new tokens, "
                   "or with --compile the most any prompt needs, so that every prompt runs the "
                   "same compiled graphs); attention reads only the key blocks written")
    p.add_argument("--clock", default="wall", choices=list(CLOCKS), help="time by wall clock, or "
                   "by this process's CPU time (steadier on a busy machine; use with --threads 1)")
    add_decoding_args(p, seed_help="seeds prompts, the acceptance stream, the sampling noise, "
                      "Huginn's and Parcae's s0",
                      dtype_help="default: the checkpoint's; float32 for random weights",
                      compile_help="the warm-up, of at least 2 tokens per method, pays for "
                      "compiling and its time is reported apart")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", default="bench_out", help="folder for the JSONL answers, each appended "
                   "as its prompt finishes, or a sweep's sweep-NAME.json, written again as each "
                   "point ends ('' for none)")
    p.add_argument("--resume", action="store_true", help="keep the answers (or a sweep's points) "
                   "in --out of an earlier run of the same command (one cut short) and measure "
                   "only the prompts some method has not answered (the points it has not)")
    p.add_argument("--overwrite", action="store_true", help="start again: replace the answers "
                   "in --out of an earlier run of the same model and methods, or the sweep "
                   "(without --resume or --overwrite such a run is refused, so that no finished "
                   "run is lost)")
    p.add_argument("--batch-size", type=int, help="decode the prompts through this many slots, "
                   "each method in one batched call (a finished sequence's slot takes the next "
                   "prompt); default: one prompt at a time")
    p.add_argument("--sweep", choices=[n for n in SWEEPS if n != "batch"], help="run every method "
                   "at each point of a sweep and print one row per point: emulated acceptance, "
                   "draft depth k, prompt length, the second proposal's depth m")
    p.add_argument("--batch-sizes", metavar="B1,B2,...", help="the batch sweep: every method at "
                   "each batch size (on the same prompts), one row per batch size")
    p.add_argument("--points", help="the sweep's points, comma-separated (default: acceptance "
                   "0.5,0.7,0.8,0.9,0.95,1.0; draft depth 1..T; prompt length 16,32,64,128; "
                   "second depth k+1..T-1)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the sweep "
                   f"({figures.PIXELS[0]}x{figures.PIXELS[1]} pixels; needs matplotlib)")
    p.add_argument("--host-time", action="store_true", help="time the host's work per tick of AR "
                   "and WFD at 1 and 8 slots, the model's calls returning at once (same shapes)")
    p.add_argument("--plot-from", metavar="SWEEP_JSON", help="print the table of a saved "
                   "sweep-NAME.json, and with --plot draw it, without running anything")
    return p.parse_args(argv)


def load_model(args, log):
    t0 = time.perf_counter()
    check_device(args.device)  # before the files: not a --model error
    with naming("--tokenizer", args.tokenizer):
        tokenizer = args.tokenizer and load_tokenizer(args.tokenizer)
    if args.random_weights:
        with naming("--random-weights", args.random_weights):
            config = read_json(args.random_weights)
        model_id = run_name(args)
        log(f"building {model_id} with random weights on {args.device} ...")
        model = models.from_config(config, args.device, DTYPES[args.dtype or "float32"],
                                   seed=args.seed, init_seed=args.init_seed)
    else:
        if args.model == DEMO and not os.path.isdir(DEMO):
            raise FileNotFoundError("no --model given and the demo model is missing: build it with "
                                    "python demo/train.py")
        model_id = run_name(args)
        log(f"loading {args.model} ...")
        with naming("--model", args.model):
            model = models.load(args.model, args.device, DTYPES.get(args.dtype), seed=args.seed)
    model.tokenizer = tokenizer or model.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  {n_params / 1e9:.3f}B parameters, {model.dtype}, {time.perf_counter() - t0:.0f} s")
    set_threads(model, args.threads)
    return model, model_id


def run_name(args):
    """The name of the run's model in its files: the checkpoint's, or its config's with -random."""
    if args.random_weights:
        return os.path.splitext(os.path.basename(args.random_weights))[0] + "-random"
    return model_name(args.model)


def model_name(source):
    """The model's name: a hub id's, a hub cache folder's (models--ORG--NAME/snapshots/HASH), else
    the folder's own."""
    path = os.path.normpath(os.path.abspath(os.path.expanduser(source)))
    cached = re.search(r"models--[^/]+?--([^/]+)/snapshots/[^/]+$", path.replace(os.sep, "/"))
    if cached:
        return cached.group(1)
    return (os.path.basename(path) if os.path.isdir(path)
            else os.path.basename(os.path.normpath(source)))


def prompt_format(args, model_id, log):
    """--prompt-format resolved, and said; auto is the official protocol's rule: the chat template
    for the reasoning fine-tunes (*-Thinking), raw text for the base checkpoints."""
    if args.prompt_format != "auto":
        return args.prompt_format
    thinking = "thinking" in model_id.lower()
    log(f"prompt format: {'chat' if thinking else 'raw'} (--prompt-format auto: {model_id} is "
        f"{'a' if thinking else 'not a'} Thinking model; the protocol gives the reasoning "
        "fine-tunes chat turns)")
    return "chat" if thinking else "raw"


def load_prompts(model, model_id, args, log):
    if args.questions:
        cats = categories(args)
        fmt = prompt_format(args, model_id, log)
        with naming("--questions", args.questions):
            prompts = specbench_prompts(model, args.questions, cats, args.per_category,
                                        fmt == "chat")
        source = f"Spec-Bench, first turns, {'chat template' if fmt == 'chat' else 'raw text'}"
    elif model.tokenizer is None or args.random_weights:
        length = args.prompt_len or 16
        prompts = random_prompts(model, args.num_prompts, length, args.seed)
        source = f"{args.num_prompts} random-id prompts of {length} tokens"
    else:
        length = args.prompt_len or 48
        prompts = stdlib_prompts(model, args.per_file, length)
        source = f"held-out stdlib files, {length} tokens from a def"
    # as the official protocol: right-truncated, and under 2 tokens skipped
    if args.max_prompt_tokens:
        prompts = [dict(p, ids=p["ids"][:args.max_prompt_tokens]) for p in prompts
                   if len(p["ids"]) >= 2]
        source += f", truncated to {args.max_prompt_tokens} tokens"
    fits = [p for p in prompts if len(p["ids"]) + args.max_new_tokens <= model.args.max_seq_len]
    if len(fits) < len(prompts):
        log(f"  skipping {len(prompts) - len(fits)} prompts longer than the context allows")
    if not fits:
        raise ValueError("no prompts to run" if not prompts else "no prompt fits the model's "
                         f"context of {model.args.max_seq_len} positions with "
                         f"--max-new-tokens {args.max_new_tokens}")
    return fits[:args.limit], source


def categories(args):
    return set(args.categories.split(",")) if args.categories else None


def check_batch_size(batch_size, prompts, flag="--batch-size"):
    if batch_size is not None and batch_size > len(prompts):
        raise ValueError(f"{flag} {batch_size} is more than the {len(prompts)} prompts: give more "
                         "prompts (--num-prompts, --limit) or a smaller batch")


def run_all(model, prompts, names, args, log, known=None, on_result=None):
    """Every method on every prompt, each reference before the runs checked against it: prompt after
    prompt, or with args.batch_size each method over the prompts in one batched call. known: name ->
    one result or None per prompt, measured before (a sweep's AR runs, which its points do not
    change; a resumed run's answers): only the Nones run. on_result(name, i, result) as each result
    is checked. Returns (name -> one result per prompt, the warm-up's seconds per method)."""
    batch = args.batch_size
    known = {n: list(known[n]) if known and n in known else [None] * len(prompts) for n in names}
    todo = {n: [i for i, r in enumerate(known[n]) if r is None] for n in names}
    fresh = [n for n in names if todo[n]]
    check_batch_size(batch, prompts)  # the run's; a resumed one has fewer left, through fewer slots
    for name in names:  # bad settings fail here, not after the reference runs
        checks.check_args(model,
                          prompts[0]["ids"] if batch is None else [p["ids"] for p in prompts],
                          args.max_new_tokens, batch_size=batch, **settings(name, args))
    compile_s = {}
    if args.warmup and fresh:
        compile_s = warm_up(model, [prompts[i] for i in todo[fresh[0]]], fresh, args, log)
    results = known  # name -> one result per prompt
    reference = lambda name: results[METHODS[name][4]] if METHODS[name][4] != name else None
    # on a terminal
    bar = tqdm(total=sum(map(len, todo.values())), unit="run", file=sys.stderr, disable=None)

    def add(name, i, r):
        """r, the result of prompt i, checked against its reference's and logged."""
        ref = reference(name) and reference(name)[i]
        plain = r["tokens"] if name == "ar" else results["ar"][i]["tokens"]
        same = ref is None or (r["tokens"] == ref["tokens"] and (  # plain: AR's tokens
            name in REFERENCE or r["stats"]["logits_digest"] == ref["stats"]["logits_digest"]))
        r.update(identical=same, ar_match=token_match(r["tokens"], plain), prompt=prompts[i])
        results[name][i] = r
        st = r["stats"]
        log(f"[{i + 1}/{len(prompts)} {prompts[i]['category']}] {name:>10}: {st['tokens']} tokens "
            f"in {r['time_s']:.2f} s ({r['tok_s']:.2f} tok/s, "
            f"{r['tok_s'] / results['ar'][i]['tok_s']:.2f}x AR), acceptance "
            f"{st['acceptance']:.2f}, {st['r_calls_per_token']:.2f} R/token"
            + (f", {st['graphs_compiled']} graphs compiled while timed" if st["graphs_compiled"]
               else "")
            + ("" if r["identical"] else "  OUTPUT DIFFERS FROM THE REFERENCE"))
        bar.update()
        if on_result:
            on_result(name, i, r)

    ref_tokens = lambda name, i: reference(name) and reference(name)[i]["tokens"]
    if batch is None:
        for i, prompt in enumerate(prompts):
            for name in fresh:
                if results[name][i] is None:
                    add(name, i,
                        run(model, prompt, name, args, args.max_new_tokens, ref_tokens(name, i)))
    else:
        for name in fresh:
            ids = todo[name]
            run_batch(model, [prompts[i] for i in ids], name, args, args.max_new_tokens,
                      [ref_tokens(name, i) for i in ids],
                      on_result=lambda j, r: add(name, ids[j], r))
            recs = [results[name][i] for i in ids]
            log(f"[batch {batch}] {name:>10}: {sum(r['stats']['tokens'] for r in recs)} tokens of "
                f"{len(ids)} prompts in {max(r['batch_s'] for r in recs):.2f} s "
                f"({summarize(recs)['tok_s']:.2f} tok/s)")
    bar.close()
    return results, compile_s


def warm_up(model, prompts, names, args, log):
    """Before the timed runs: compiled, every graph each method's runs can meet
    (engine.compile_graphs: every key-block bucket up to the capacity, at its width and batch), then
    a run of args.warmup tokens of each method (one token, the prefill alone, is the same for every
    method: one run touches all the weights). Returns the seconds each method's warm-up took."""
    batch, tokens, seconds = args.batch_size, args.warmup, {}
    log(f"warm-up: {tokens} tokens, {', '.join(names if tokens > 1 else names[:1])}"
        + (" after compiling every graph of each" if args.compile else ""))
    for name in names:
        t0 = time.perf_counter()
        if args.compile and name not in REFERENCE:  # the reference runs eager
            ids = prompts[0]["ids"] if batch is None else [p["ids"] for p in prompts]
            graphs = engine.compile_graphs(model, ids, args.max_new_tokens, batch_size=batch,
                                           digest_logits=True, **settings(name, args))
            log(f"{name}: {compiling_line(graphs, time.perf_counter() - t0, model.device)}")
        if tokens > 1 or name == names[0]:
            if batch is None:
                run(model, prompts[0], name, args, tokens)
            else:
                run_batch(model, prompts[:batch], name, args, tokens)
        seconds[name] = time.perf_counter() - t0
    return seconds


def decoding(args):
    if args.temperature == 0:
        return "greedy"
    filters = "".join(f", {name} {v}" for name, v in (("top-k", args.top_k), ("top-p", args.top_p))
                      if v is not None)
    return f"sampled at temperature {args.temperature}{filters}, seed {args.seed}"


def print_costs(model, T, names, figs, results, args):
    """What a call costs, one prompt at a time: AR against the bound of reading the weights, the
    time per R call, and on a CPU the R calls' share of the time."""
    per_token, bandwidth = weight_bytes_per_token(model, T), memory_bandwidth(model.device)
    bound = bandwidth / per_token
    print(f"\nBandwidth bound: {bound:.2f} tok/s ({per_token / 1e9:.3f} GB of weights read per AR "
          f"token, {bandwidth / 1e9:.1f} GB/s measured by a copy on the device); AR decodes at "
          f"{figs['ar']['decode_tok_s']:.2f} tok/s, "
          f"{100 * figs['ar']['decode_tok_s'] / bound:.1f}% of it")
    per_call = {n: sum(r["time_s"] for r in results[n])
                   / sum(r["stats"]["r_calls"] for r in results[n])
                for n in names}
    print(f"\nTime per R call ({args.clock} clock; C calls and overhead included): "
          + ", ".join(f"{METHODS[n][3]} {1000 * t:.1f} ms" for n, t in per_call.items()))
    if model.device.type == "cpu":  # on a GPU a call returns before its work is done
        def r_time(recs):  # the R calls after the prefill, whose T calls r_calls counts too
            r_s = sum(r["stats"]["r_seconds"] for r in recs)
            calls = sum(r["stats"]["r_calls"] - r["stats"]["num_steps"] for r in recs)
            # 1 token: the prefill's alone
            each = f"{1000 * r_s / calls:.2f} ms each" if calls else "none"
            return f"{each}, {100 * r_s / sum(r['stats']['wall_s'] for r in recs):.0f}% of the time"
        print("\nR calls after the prefill, wall clock (the rest of the time: the prefill, C, P "
              "and the schedule): "
              + "; ".join(f"{METHODS[n][3]} {r_time(results[n])}" for n in names
                          if n not in REFERENCE))  # the reference times no call alone


def fewer_slots(results, args):
    """What the header says of the prompts a resumed batched run measured through fewer slots than
    --batch-size (fewer prompts were left than it)."""
    fewer = {r["stats"]["batch_size"] for recs in results.values() for r in recs
             if args.batch_size and r["stats"]["batch_size"] < args.batch_size}
    return (f"; the prompts left after resuming ran through {' or '.join(map(str, sorted(fewer)))} "
            "slots (fewer prompts than the batch were left)" if fewer else "")


def print_summary(model, model_id, prompts, source, names, results, compile_s, args, argv,
                  resumed=0):
    """The header, a table per category and overall, the legend: markdown to paste."""
    T = model.num_steps if args.steps is None else args.steps
    k = (checks.default_draft_steps(model, args.steps) if args.draft_steps is None
         else args.draft_steps)
    emulated = f", emulated acceptance A={args.acceptance}" if args.acceptance is not None else ""
    device = figures.machine_text(model.device, machine(model.device), torch.get_num_threads())
    print(f"## bench.py: {model_id}{emulated}\n")
    print(f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {device}; torch "
          f"{torch.__version__}; {str(model.dtype).replace('torch.', '')}; {args.clock} clock")
    print(f"- `{shlex.join(['python', 'bench.py'] + (sys.argv[1:] if argv is None else argv))}`")
    print(f"- T={T}, k={k}, DtV draft length {args.draft_len}; {len(prompts)} prompts ({source}), "
          f"up to {args.max_new_tokens} new tokens, "
          f"{decoding(args)}, {figures.batch_text(args.batch_size)}{fewer_slots(results, args)}"
          + (f"; compiled ({figures.compiled_text(model.device)}), KV "
             f"capacity {args.capacity}" if args.compile else "") + "\n")
    by_cat = defaultdict(list)
    for i, p in enumerate(prompts):
        by_cat[p["category"]].append(i)
    # a batch's time is its call's, not a category's
    if len(by_cat) > 1 and args.batch_size is None:
        for cat, ids in by_cat.items():
            print(f"### {cat} ({len(ids)} prompts)\n\n"
                  f"{table(results, names, ids, args.compile)[0]}\n")
    text, figs = table(results, names, range(len(prompts)), args.compile)
    again = f", {resumed} of them resumed from {args.out}" if resumed else ""
    print(f"### overall ({len(prompts)} prompts{again}{emulated})\n\n{text}\n\n{LEGEND}"
          + ("" if args.batch_size is None else "\n" + figures.BATCH_LEGEND))
    if compile_s:
        print("\nWarm-up, wall clock" + (" (compiling: a method at a width compiled before by "
              "another finds its graphs)" if args.compile else "") + ": "
              + ", ".join(f"{METHODS[n][3]} {t:.1f} s" for n, t in compile_s.items()))
    if args.batch_size is None:
        print_costs(model, T, names, figs, results, args)
    if "wfd" in figs and not math.isnan(figs["wfd"]["acceptance"]):
        a, ar, wave = figs["wfd"]["acceptance"], figs["ar"], figs["wfd"]
        ideal = lambda A: figures.ideal_speedup(T, k, A)
        at_A = (f"{ideal(args.acceptance):.2f}x at A={args.acceptance}, "
                if args.acceptance is not None else "")
        print(f"\nIdeal WFD speedup T / (A*k + (1-A)*T): {at_A}{ideal(a):.2f}x at the measured "
              f"{a:.3f}; WFD reaches {wave['tok_s'] / ar['tok_s'] / ideal(a):.2f} of it (decoding "
              f"alone: {wave['decode_tok_s'] / ar['decode_tok_s'] / ideal(a):.2f}); R-call ratio "
              f"measured: {ar['r_per_token'] / wave['r_per_token']:.2f}x")
    if "wfd-2" in figs and not math.isnan(figs["wfd-2"]["acceptance"]):
        two, m = figs["wfd-2"], args.second_depth
        a, r = two["accepts"], two["rescues"]
        calls = figures.second_proposal_calls(T, k, m, a, r)
        print(f"\nSecond proposal at m={m}: {two['r_per_token']:.2f} R calls per token measured "
              f"(prefill included; {two['r_per_decoded']:.2f} per token after the first, the "
              f"prefill aside), {calls:.2f} by a*k + r*m + (1-a-r)*T at the measured "
              f"shares of the verifies accepted a={a:.3f} and rescued r={r:.3f} (an ideal speedup of "
              f"{T / calls:.2f}x); WFD-2 at {two['tok_s'] / ar['tok_s']:.2f}x AR; its branch "
              f"columns: {two['branch_kib']:.1f} KiB of its {two['kv_mib']:.1f} MiB of KV")
    if "ref-ar" in figs:
        base = figs["ref-ar"]["tok_s"]
        print(f"\nThe reference's AR (wfd.py's loop, eager: a plain forward, one row per call, one "
              f"SDPA call per layer), {base:.2f} tok/s: " + ", ".join(
                  f"{METHODS[n][3]} {f['tok_s'] / base:.2f}x of it" for n, f in figs.items()
                  if n != "ref-ar"))
    if args.compile:
        graphs = sum(f["graphs"] for f in figs.values())
        print(f"\nGraphs compiled during the timed runs: {graphs}" + (
            " (the warm-up compiled every graph they met)" if graphs == 0 else
            ": these timings contain compiling (--warmup 0, or a graph the warm-up did not make)"))
    return figs


# -- the paper's protocol (the official code's experiments/exp2_spec_bench) ------------------------

QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "specbench",
                         "question.jsonl")
PAPER = {  # family: (T, k, methods); Ouro's k=2 as well: add --draft-steps 2. The families the
    # paper leaves out: their own T and the default k (max(1, T // 8))
    "ouro": (4, 1, "ar,wfd"),
    "huginn": (32, 4, "ar,wfd,wfd-shared"),
    "parcae": (8, 2, "ar,wfd"),
    "loopformer": (None, None, "ar,wfd"),
    "retrofit": (None, None, "ar,wfd,wfd-shared"),
}
PAPER_SPEEDUPS = {"ouro-2.6b": {"wfd": 2.42},
                  "huginn-0125": {"wfd": 3.54, "wfd-shared": 4.81}}  # over AR
# the paper's methods, and ours beside them: the paper's cross-recurrence KV sharing is lossy (its
# output may leave AR's); wfd-shared is this project's own rule (docs/shared-kv.md), exact against
# AR with the same shared cache: another method, not a measurement of the paper's
PAPER_NAMES = {"wfd": ("WFD", "ours"),
               "wfd-shared": ("WFD with the paper's cross-recurrence KV sharing, lossy",
                              "ours, another method: WFD with this project's exact shared KV")}


def paper_protocol(args):
    """The flags of the paper's Spec-Bench protocol for args.model: the 480 questions (ids 81-560,
    the shipped file), first turns, in the format of --prompt-format auto, right-truncated to 512
    tokens, 512 new tokens, the family's T and k, bfloat16."""
    if args.random_weights:
        raise ValueError("--paper runs the Spec-Bench questions through a checkpoint's tokenizer: "
                         "give --model, not --random-weights")
    ckpt = checkpoints.Checkpoint(args.model)  # LoopFormer's T: from its repo id, where needed
    a = models.ModelArgs.from_config(ckpt.config, ckpt.weights.keys())
    T, k, methods = PAPER[a.kind]
    T = T or a.num_steps
    k = k or max(1, T // 8)
    return ["--questions", QUESTIONS, "--prompt-format", "auto", "--max-prompt-tokens", "512",
            "--max-new-tokens", "512", "--steps", str(T), "--draft-steps", str(k), "--dtype",
            "bfloat16", "--methods", methods]


def print_paper(model_id, figs):
    """The paper's speedups over AR for this model, beside ours."""
    paper = PAPER_SPEEDUPS.get(model_id.lower())
    if paper is None:
        print(f"\nThe paper reports no Spec-Bench speedup for {model_id}.")
        return
    print("\nSpeedup over AR, the paper's (Ha & Kim, on its GPU) beside ours: " + "; ".join(
        f"{name} {paper[n]:.2f}x ({ours}: "
        + (f"{figs[n]['tok_s'] / figs['ar']['tok_s']:.2f}x)" if n in figs else "not run)")
        for n, (name, ours) in PAPER_NAMES.items() if n in paper))


def check_sweep_args(args):
    """--sweep, --batch-sizes, --plot and --plot-from refused where they cannot run, before any
    work; --batch-sizes becomes the sweep "batch" from here on."""
    if args.batch_sizes is not None:
        if args.sweep or args.points:
            raise ValueError("--batch-sizes is a sweep of its own: not with --sweep or --points")
        if args.batch_size is not None:
            raise ValueError("--batch-sizes sets --batch-size at each point: give one of the two")
        args.sweep, args.points = "batch", args.batch_sizes
    if args.plot_from and args.sweep:
        raise ValueError("--plot-from draws saved points: give it or --sweep, not both")
    if args.plot and not (args.sweep or args.plot_from):
        raise ValueError("--plot draws a sweep: give --sweep NAME, or --plot-from a "
                         "saved sweep-NAME.json")
    if args.points and not args.sweep:
        raise ValueError("--points needs --sweep NAME")
    param = SWEEPS[args.sweep][0] if args.sweep else None
    if param and getattr(args, param) is not None:
        raise ValueError(f"--sweep {args.sweep} sets --{param.replace('_', '-')} at each point: "
                         "give the points with --points")
    if args.sweep == "length" and args.questions:
        raise ValueError("--sweep length sets the prompts' length: not with --questions, whose "
                         "prompts are the questions")
    if args.plot:
        figures.need_matplotlib()
        folder = os.path.dirname(os.path.abspath(args.plot))
        try:  # fails now, not after the sweep
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise OSError(f"--plot {args.plot}: cannot make the folder "
                          f"{folder} ({err.strerror})") from None


def sweep_main(model, model_id, names, args, argv, log, saved):
    """A sweep, its sweep-NAME.json in --out rewritten as each point ends (a new file that then
    replaces the old: a kill leaves one of them whole); saved: the points of its earlier run
    (resumed_points), kept."""
    path = args.out and sweep_path(args)

    def save(sweep):
        with open(path + ".new", "w") as f:
            json.dump(sweep, f, indent=1, allow_nan=False)
        os.replace(path + ".new", path)

    if path:
        with naming("--out", args.out):
            os.makedirs(args.out, exist_ok=True)
    sweep = run_sweep(model, model_id, names, args, argv, log, saved, path and save)
    print(figures.text(sweep))
    if path:
        save(sweep)
        log(f"points: {path}")
    if args.plot:
        figures.plot(sweep, args.plot)
        log(f"figure: {args.plot}")
    return sweep


def sweep_path(args):
    return os.path.join(args.out, f"sweep-{args.sweep}.json")


def resumed_points(args, model_id):
    """With --resume, the points of the sweep in --out, by their x, if it is of this run (none if
    there is no file); before the model loads."""
    path = sweep_path(args)
    if not (args.resume and os.path.exists(path)):
        return None
    run_id = fingerprint(model_id, args)
    sweep = figures.read_sweep(path)
    if sweep.get("run_id") != run_id:
        raise ValueError(f"--resume: {path} holds a sweep of another run (other flags or model): "
                         "--resume continues the same command; --overwrite starts again")
    return {p["x"]: p for p in sweep["points"]}


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    if args.paper:  # the protocol's flags first, so that the ones given win
        given = sys.argv[1:] if argv is None else argv
        protocol = paper_protocol(args)
        argv = protocol + given
        args = parse_args(argv)
        print(f"paper protocol: {shlex.join(protocol)}; then as given: {shlex.join(given)}\n")
    log = lambda msg: tqdm.write(msg, file=sys.stderr)  # above the progress bar, when there is one
    resolve_compile(args)
    check_at_least(args, limit=1, per_category=1, per_file=1, num_prompts=1, prompt_len=1, warmup=0,
                   threads=1, max_prompt_tokens=1, batch_size=1, seed=0, init_seed=0)
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        raise ValueError(f"--acceptance is a probability, in 0..1, not {args.acceptance}")
    if args.second_acceptance is not None and (
            args.acceptance is None or not args.acceptance <= args.second_acceptance <= 1):
        raise ValueError("--second-acceptance B needs --acceptance A, and A <= B <= 1 (a deeper "
                         f"read is right at least as often), not {args.second_acceptance}")
    check_sweep_args(args)
    if (args.resume or args.overwrite) and (not args.out or args.plot_from):
        raise ValueError("--resume and --overwrite go on with or replace the answers or the sweep "
                         "of an earlier run in --out: they need --out, and no --plot-from")
    if args.overwrite and args.resume:
        raise ValueError("--overwrite starts the run in --out again: not --resume, which goes "
                         "on with it")
    if args.plot_from:
        sweep = figures.read_sweep(args.plot_from)
        print(figures.text(sweep))
        if args.plot:
            figures.plot(sweep, args.plot)
            log(f"figure: {args.plot}")
        return None
    if args.capacity is not None and args.capacity < args.max_new_tokens:
        raise ValueError(f"--capacity {args.capacity} cannot hold --max-new-tokens "
                         f"{args.max_new_tokens} after a prompt: the KV cache holds the prompt "
                         "and the new tokens but the last")
    if args.points:
        parse_points(args)
    second = args.second_depth is not None or args.sweep == "second-depth"
    if args.methods is None:  # the reference's rows beside the engine's, where it can run them
        alone = args.temperature == 0 and args.batch_size is None and not args.sweep
        args.methods = "ar,dtv,wfd,wfd-shared" + ",ref-wfd" * alone
    given = [n.strip() for n in args.methods.split(",") if n.strip()]
    if not given:
        raise ValueError(f"--methods names no method: choose from {', '.join(METHODS)}")
    names = given + (["wfd"] if args.sweep else []) + (["wfd-2"] if second else [])
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    # 1-row AR always runs (the baseline), and each method's exact reference before the method
    names = ["ar"] + [n for n in METHODS
                      if n != "ar" and (n in names or any(METHODS[m][4] == n for m in names))]
    own = [n for n in names if n in REFERENCE]
    if own and (args.temperature != 0 or args.batch_size or args.sweep == "batch"):
        raise ValueError(f"--methods {own[0]} runs wfd.py's loop, greedy and one prompt at a time "
                         "(no --temperature, --batch-size or --batch-sizes)")
    if not args.host_time:
        check_out(args, run_name(args), names)
    if args.questions:  # its mistakes refused now; read again with the model's tokenizer
        read_questions(args.questions, categories(args), args.per_category)
    saved = resumed_points(args, run_name(args)) if args.sweep else None
    model, model_id = load_model(args, log)
    if args.host_time:
        torch.set_num_threads(1)
        return host_time(model, args, log)
    if args.sweep:
        return sweep_main(model, model_id, names, args, argv, log, saved)
    prompts, source = load_prompts(model, model_id, args, log)
    fix_capacity(args, prompts)
    with naming("--out", args.out):
        answers = Answers(model, model_id, names, prompts, args) if args.out else None
    if answers:
        log(f"answers: {args.out}/{model_id}-{{{','.join(names)}}}.jsonl, each appended as its "
            "prompt finishes"
            + (f"; {answers.resumed} of {len(prompts)} prompts resumed" if args.resume else ""))
    try:
        results, compile_s = run_all(model, prompts, names, args, log, answers and answers.known,
                                     answers and answers.write)
    except KeyboardInterrupt:
        raise KeyboardInterrupt("interrupted" + (f": the finished answers are in {args.out}; the "
                                                 "same command with --resume measures the rest"
                                                 if answers else "")) from None
    finally:
        if answers:
            answers.close()
    figs = print_summary(model, model_id, prompts, source, names, results, compile_s, args, argv,
                         answers.resumed if answers else 0)
    if args.paper:
        print_paper(model_id, figs)
    return dict(names=names, figs=figs, results=results)


if __name__ == "__main__":
    main()
