"""Generate with a looped LM: python run.py --prompt "def fib(n):" [--model FOLDER_OR_HUB_ID] ...

Without --model it runs the small demo model that ships in demo/ (see demo/train.py). Many prompts,
decoded together: python run.py --prompts-file prompts.txt --batch-size 4 (one prompt per line, or a
.jsonl file with one {"prompt": TEXT} or {"prompt_ids": [IDS]} per line); each answer prints as its
prompt finishes."""
if __name__ == "__main__":  # Ctrl-C while torch imports: one line and status 130
    from cli import interrupt_quietly
    interrupt_quietly()

import argparse
import os
import sys
import time

import engine
import models
import wfd
from cli.args import (DEMO, DTYPES, TOKENIZER_HELP, Parser, add_decoding_args, check_at_least,
                      compiling_line, naming, one_line_errors, refuse_engine_only,
                      resolve_compile, set_threads)
from cli.output import TextStream, draw_wavefront, json_line, stats_line, text_of, token_match
from cli.prompts import default_eos, line_named, prompt_lines, read_prompt, read_prompts
from engine import checks
from formats.checkpoints import load_tokenizer
from formats.devices import check_device


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO,
                   help="model folder or Hugging Face hub id (default: the demo model)")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", metavar="FILE", help="many prompts, decoded together: one "
                     "text per line (blank lines skipped), or a .jsonl file with one object per "
                     "line holding \"prompt\" (text) or \"prompt_ids\" (token ids)")
    p.add_argument("--batch-size", type=int, help="with --prompts-file: the sequences decoded "
                   "together (default: every prompt); a finished sequence's slot takes the "
                   "next prompt")
    p.add_argument("--method", default="wfd", choices=["wfd", "ar", "dtv", "all"])
    p.add_argument("--engine", default="engine", choices=["engine", "reference"],
                   help="engine (default): engine/, exact and fast, every option; reference: "
                   "wfd.py's plain loop, greedy, one prompt")
    p.add_argument("--width", type=int, help="rows per call (default: ceil(T / k) for wfd and ar, "
                   "draft-len + 1 for dtv); --method ar --width 1 is plain decoding")
    p.add_argument("--kv", default="full", choices=["full", "shared"],
                   help="KV cache: per depth, or shared across depths")
    add_decoding_args(p, seed_help="the run's randomness: the sampling noise and Huginn's and "
                      "Parcae's random initial state",
                      dtype_help="default: the checkpoint's",
                      compile_help="a short run of each method compiles them")
    p.add_argument("--state-init", default="random", choices=["random", "zero"],
                   help="Huginn's and Parcae's initial state")
    p.add_argument("--chat", action="store_true", help="wrap --prompt (or each text prompt) as one "
                   "user turn in the checkpoint's chat template (tokenizer_config.json; else its "
                   "family's format) and stop at the end of the turn too")
    p.add_argument("--eos", help="stop token ids, comma-separated, '' for none (default: "
                   "generation_config.json's eos_token_id, else config.json's, else the "
                   "tokenizer's <|eos|>; with --chat also the template's end-of-turn token)")
    p.add_argument("--json", action="store_true", help="print one JSON object per method "
                   "(prompt_ids, tokens, text, stats) instead of text; with --prompts-file one per "
                   "prompt, with its index")
    p.add_argument("--show-wavefront", action="store_true",
                   help="draw the (position x depth) schedule of the first ticks")
    return p.parse_args(argv)


def compile_runs(model, prompts, runs, settings, args, batch_size=None):
    """--compile: every graph the runs will meet compiled before they run
    (engine.compile_graphs), at one KV capacity, that of the longest prompt (prompts: one prompt,
    or a file's, decoded together)."""
    longest = max(map(len, prompts)) if isinstance(prompts[0], list) else len(prompts)
    settings["capacity"] = longest + args.max_new_tokens - 1
    t0, graphs = time.perf_counter(), 0
    for _, method, width, second in runs:
        graphs += engine.compile_graphs(model, prompts, args.max_new_tokens, method=method,
                                        width=width, batch_size=batch_size, second_depth=second,
                                        digest_logits=len(runs) > 1, **settings)
    print(compiling_line(graphs, time.perf_counter() - t0, model.device), file=sys.stderr)


def decode_file(args, model, lines, method, width, settings):
    """--prompts-file: every prompt (lines: prompt_lines's) through --batch-size slots, each answer
    printed as its prompt finishes."""
    lines, prompts, eos = read_prompts(args, model, lines)
    for n, prompt in zip(lines, prompts):  # a prompt's mistake named by its line, before any output
        with line_named(args.prompts_file, n):
            checks.check_args(model, prompt, args.max_new_tokens, method=method, width=width,
                              eos_token_id=eos, second_depth=args.second_depth, **settings)
    checks.check_args(model, prompts, args.max_new_tokens, method=method, width=width,
                      eos_token_id=eos, batch_size=args.batch_size,
                      second_depth=args.second_depth, **settings)
    # as generate's
    slots, tok = min(args.batch_size or len(prompts), len(prompts)), model.tokenizer
    if args.compile:
        compile_runs(model, prompts, [(method, method, width, args.second_depth)], settings, args,
                     args.batch_size)

    def finish(i, out):
        if args.json:
            print(json_line(method, prompts[i], out, tok, index=i), flush=True)
        else:
            print(f"[prompt {i}] {text_of(tok, out)}")
            print(stats_line(f"{method}, prompt {i}, slot {out.stats['slot']}", out.stats),
                  flush=True)

    t0 = time.perf_counter()
    outs = engine.generate(model, prompts, args.max_new_tokens, method=method, width=width,
                           eos_token_id=eos, batch_size=args.batch_size, on_finish=finish,
                           second_depth=args.second_depth, **settings)
    wall, tokens = time.perf_counter() - t0, sum(len(out.tokens) for out in outs)
    if not args.json:
        print(f"[{method}] {len(prompts)} prompts through {slots} slots: {tokens} tokens in "
              f"{wall:.2f} s, {tokens / wall:.1f} tok/s")


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    check_at_least(args, threads=1, batch_size=1, seed=0)
    if args.engine == "reference":
        refuse_engine_only(args, "--width", "--batch-size", "--prompts-file", "--temperature",
                           "--top-k", "--top-p", "--compile", "--second-depth", "--show-wavefront")
    resolve_compile(args)
    if args.batch_size is not None and args.prompts_file is None:
        raise ValueError("--batch-size needs --prompts-file: one prompt decodes alone")
    if args.prompts_file is not None and (args.method == "all" or args.show_wavefront):
        raise ValueError("--prompts-file decodes with one method, without --show-wavefront: for "
                         "--method all on many prompts use bench.py (--batch-size)")
    if args.model == DEMO and not os.path.isdir(DEMO):
        raise FileNotFoundError("no --model given and the demo model is missing: build it with "
                                "python demo/train.py")
    lines = prompt_lines(args)  # a prompt that is not text refused before the model loads
    check_device(args.device)  # before the files: not a --model error
    with naming("--tokenizer", args.tokenizer):  # before the weights: it fails quicker
        tokenizer = args.tokenizer and load_tokenizer(args.tokenizer)
    with naming("--model", args.model):
        model = models.load(args.model, device=args.device, dtype=DTYPES.get(args.dtype),
                            state_init=args.state_init, seed=args.seed)
    model.tokenizer = tokenizer or model.tokenizer
    if not model.args.config_stop_ids and args.eos is None and not default_eos(model):
        # LoopFormer's configs name no stop id, the retrofits' stale ones: the tokenizer's is
        # the one
        problem = ("has no tokenizer.json: give --tokenizer" if model.tokenizer is None else
                   "has a tokenizer without an eos token")
        raise ValueError(f"{args.model} {problem} (a {model.kind} model's stop id comes from its "
                         "tokenizer), or the stop ids with --eos")
    set_threads(model, args.threads)
    settings = dict(num_steps=args.steps, draft_steps=args.draft_steps, draft_len=args.draft_len,
                    kv=args.kv, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, compile=args.compile)
    if args.prompts_file is not None:
        return decode_file(args, model, lines, args.method, args.width, settings)
    (prompt, eos), tok = read_prompt(args, model), model.tokenizer
    if args.engine == "reference":
        return run_reference(args, model, prompt, eos)
    # (name, method, width, second depth); all: plain AR (the speed baseline), and each schedule
    # after AR at its width (and second depth), its exact reference
    m = args.second_depth
    runs = ([("ar1", "ar", 1, None), ("ar", "ar", args.width, m), ("wfd", "wfd", args.width, m),
             ("ar-dtv", "ar", args.draft_len + 1, None), ("dtv", "dtv", None, None)]
            if args.method == "all" else [(args.method, args.method, args.width, m)])
    if args.kv == "shared" and args.method == "all":
        runs = runs[:3]
        print("note: skipping dtv, which cannot share KV exactly (its verify pass writes "
              "final-depth KV of positions it may reject)", file=sys.stderr)
    for _, method, width, second in runs:  # every input error out before the first line of output
        checks.check_args(model, prompt, args.max_new_tokens, method=method, width=width,
                          eos_token_id=eos, second_depth=second, **settings)
    if args.compile:
        compile_runs(model, prompt, runs, settings, args)
    stream = not args.json and len(runs) == 1 and tok is not None
    results = {}
    for name, method, width, second in runs:
        text = (TextStream(tok, prompt, checks.stop_ids(eos, model.args.vocab_size)) if stream
                else None)
        trace = [] if args.show_wavefront and method == "wfd" else None
        out = engine.generate(model, prompt, args.max_new_tokens, method=method, width=width,
                              eos_token_id=eos, on_token=text.add if text else None, trace=trace,
                              digest_logits=len(runs) > 1, second_depth=second, **settings)
        results[name] = out
        stats = out.stats
        if args.json:
            print(json_line(name, prompt, out, tok))
            continue
        if text:
            text.show()
        else:
            print(f"[{name}] {text_of(tok, out)}")
        print(stats_line(name, stats))
        if trace:
            label = (lambda t: repr(tok.decode([t]))) if tok else str
            print(draw_wavefront(trace, out.tokens, len(prompt), stats["num_steps"],
                                 stats["draft_steps"], label, second_depth=second))
    if len(runs) > 1 and not args.json:
        same = lambda a, b: (a.tokens == b.tokens
                             and a.stats["logits_digest"] == b.stats["logits_digest"])
        exact = all(same(results[a], results[b]) for a, b in (("wfd", "ar"), ("dtv", "ar-dtv"))
                    if a in results)
        print("outputs identical to AR at the same width (tokens and logits): "
              + ("yes" if exact else "NO"))
        plain = results["ar1"]
        for method, r in results.items():
            match = token_match(r.tokens, plain.tokens)
            print(f"  {method:>6}: width {r.stats['width']}, "
                  f"{r.stats['tokens_per_s'] / plain.stats['tokens_per_s']:.2f}x plain AR, "
                  f"{r.stats['r_calls_per_token']:.2f} R calls/token, {100 * match:.0f}% of plain "
                  "AR's tokens")


def run_reference(args, model, prompt, eos):
    """--engine reference: wfd.py's loop, greedy, one method after another; with --method all, AR
    first, then whether the reference's WFD and DtV gave its AR's tokens."""
    methods = ["ar", "wfd", "dtv"] if args.method == "all" else [args.method]
    if args.kv == "shared":  # DtV cannot share KV exactly (run's note for the engine says why)
        methods = [m for m in methods if m != "dtv"] or methods
    settings = dict(num_steps=args.steps, draft_steps=args.draft_steps, draft_len=args.draft_len,
                    eos_token_id=eos, kv=args.kv)
    for method in methods:  # every input error out before the first line of output
        checks.check_args(model, prompt, args.max_new_tokens, method=method, **settings)
    tok, outs = model.tokenizer, {}
    for method in methods:
        stream = len(methods) == 1 and not args.json and tok is not None
        stop = checks.stop_ids(eos, model.args.vocab_size)
        text = TextStream(tok, prompt, stop) if stream else None
        out = outs[method] = wfd.generate(model, prompt, args.max_new_tokens, method=method,
                                          on_token=text and text.add, **settings)
        if args.json:
            print(json_line(f"reference {method}", prompt, out, tok))
            continue
        if text:
            text.show()
        else:
            print(f"[reference {method}] {text_of(tok, out)}")
        print(stats_line(f"reference {method}", out.stats))
    if len(methods) > 1 and not args.json:
        same = all(out.tokens == outs["ar"].tokens for out in outs.values())
        print(f"reference: {' and '.join(dict(wfd='WFD', dtv='DtV')[m] for m in methods[1:])} gave "
              "AR's tokens: "
              + ("yes" if same else "NO"))


if __name__ == "__main__":
    main()
