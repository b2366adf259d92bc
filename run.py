"""Generate with a looped LM: python run.py --prompt "def fib(n):" [--model FOLDER_OR_HUB_ID] ...

Without --model it runs the small demo model that ships in demo/ (see train_demo.py)."""
import argparse
import json
import os
import sys

import torch

import models
import wfd

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO, help="model folder or Hugging Face hub id (default: the demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--method", default="wfd", choices=["wfd", "ar", "dtv", "all"])
    p.add_argument("--steps", type=int, help="full depth T (default: the model's)")
    p.add_argument("--draft-steps", type=int, help="draft depth k (default: the config's wfd_draft_steps, else max(1, T // 8))")
    p.add_argument("--draft-len", type=int, default=4, help="drafts per draft-then-verify round")
    p.add_argument("--width", type=int, help="rows per call (default: ceil(T / k) for wfd and ar, draft-len + 1 "
                   "for dtv); --method ar --width 1 is plain decoding")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv", default="full", choices=["full", "shared"], help="KV cache: per depth, or shared across depths")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    p.add_argument("--threads", type=int, help="CPU threads (default: 1 for models under 100M parameters, "
                   "whose matmuls are too small to share between cores; else torch's default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample, "
                   "with the same tokens from every method")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the most likely tokens that reach probability p")
    p.add_argument("--seed", type=int, default=0, help="the run's randomness: the sampling noise and "
                   "Huginn's random initial state")
    p.add_argument("--state-init", default="random", choices=["random", "zero"], help="Huginn's initial state")
    p.add_argument("--eos", type=int, help="stop token id (default: the config's eos_token_id)")
    p.add_argument("--json", action="store_true", help="print one JSON object per method instead of text")
    p.add_argument("--show-wavefront", action="store_true", help="draw the (position x depth) schedule of the first ticks")
    return p.parse_args(argv)


def default_eos(model):
    eos = model.config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


def draw_wavefront(trace, tokens, first_pos, num_steps, k, label, ticks=24):
    """The (position x depth) picture of the first R calls of a WFD run: one column per R call, one
    line per row (a position, named by the token it reads in; a rejected draft and the row that
    replaces it get a line each), the cell holding the depth the row reached in that call.
    tokens: the committed tokens."""
    trace = trace[:ticks]
    width = len(str(num_steps)) + 4
    pending, active, lines = {}, {}, []
    for t, tick in enumerate(trace):
        for pos, depth in tick["rows"]:
            if depth == 1:  # the row's first R call
                token = pending.pop(pos) if pos in pending else tokens[pos - first_pos]
                active[pos] = dict(name=f"#{pos - first_pos + 1:<3} {label(token)}", cells={})
                lines.append(active[pos])
            verdict = {tick.get("accepted"): "+", tick.get("rejected"): "x"}.get(pos, "")
            if "rejected" in tick and pos > tick["rejected"]:
                verdict = "-"
            mark = ("=" if depth == num_steps else "") + verdict + ("d" if tick.get("drafted") == pos + 1 else "")
            active[pos]["cells"][t] = f"{depth}{mark}"
        if "drafted" in tick:
            pending[tick["drafted"]] = tick["draft"]
    name_w = max(len(line["name"]) for line in lines)
    out = [" " * name_w + "  R call " + "".join(f"{t + 1:>{width}}" for t in range(len(trace)))]
    for line in lines:
        cells = "".join(f"{line['cells'].get(t, ''):>{width}}" for t in range(len(trace)))
        out.append(f"{line['name']:<{name_w}}         {cells}".rstrip())
    committed = sum(1 for tick in trace for pos, depth in tick["rows"] if depth == num_steps)
    out += [f"One column per R call (the looped block run once over a batch of rows), one line per row:",
            f"a new token's position, named by the token it reads in. The number is the depth that row",
            f"reached in that call.",
            f"  d  read at the draft depth k={k}: its token is a draft, and the next position starts at once",
            f"  =  read at the full depth T={num_steps}: AR's token, committed; it checks the draft of the next line",
            f"  +  this row's draft was checked and accepted",
            f"  x  this row's draft was rejected: the row is dropped (- and the rows drafted from it), and the",
            f"     position starts again from depth 1 with the committed token",
            f"{committed} tokens committed in {len(trace)} R calls; AR takes {num_steps} R calls per token."]
    return "\n".join(out)


def set_threads(model, threads=None):
    """`threads` CPU threads, or one for a model under 100M parameters: its matmuls are too small to
    gain from more, and lose a lot when another process holds a core."""
    if threads or sum(p.numel() for p in model.parameters()) < 100e6:
        torch.set_num_threads(threads or 1)


def main(argv=None):
    args = parse_args(argv)
    if args.model == DEMO and not os.path.isdir(DEMO):
        sys.exit("no --model given and the demo model is missing: build it with python train_demo.py")
    model = models.load(args.model, device=args.device, dtype=DTYPES.get(args.dtype),
                        state_init=args.state_init, seed=args.seed)
    set_threads(model, args.threads)
    if args.prompt_ids is not None:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif model.tokenizer is None:
        sys.exit(f"{args.model} has no tokenizer.json: pass --prompt-ids instead of --prompt")
    else:
        prompt = model.tokenizer.encode(args.prompt).ids
    eos = args.eos if args.eos is not None else default_eos(model)
    # all: plain AR (the speed baseline), then each schedule after AR at its width (its exact reference)
    methods = ["ar1", "ar", "wfd", "ar-dtv", "dtv"] if args.method == "all" else [args.method]
    stream = not args.json and len(methods) == 1 and model.tokenizer is not None
    results = {}
    for method in methods:
        shown = []
        def on_token(tok, shown=shown):  # print the text as tokens commit
            shown.append(tok)
            if stream:
                print(model.tokenizer.decode(prompt + shown)[len(model.tokenizer.decode(prompt + shown[:-1])):],
                      end="", flush=True)
        trace = [] if args.show_wavefront and method == "wfd" else None
        if stream:
            print(args.prompt, end="", flush=True)
        width = {"ar1": 1, "ar-dtv": args.draft_len + 1}.get(method, args.width)
        out = wfd.generate(model, prompt, args.max_new_tokens, method=method[:2] if method[:2] == "ar" else method,
                           num_steps=args.steps, draft_steps=args.draft_steps, draft_len=args.draft_len,
                           width=width, eos_token_id=eos, kv=args.kv, on_token=on_token, trace=trace,
                           keep_logits=len(methods) > 1, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed)
        results[method] = out
        st = out.stats
        if args.json:
            print(json.dumps({**st, "tokens": out.tokens}))  # the token ids, in place of their count
            continue
        if stream:
            print()
        elif model.tokenizer is not None:
            print(f"[{method}] {model.tokenizer.decode(out.tokens)}")
        else:
            print(f"[{method}] {out.tokens}")
        print(f"[{method}] {st['tokens']} tokens, {st['r_calls']} R calls ({st['r_calls_per_token']:.2f}/token), "
              f"T={st['num_steps']} k={st['draft_steps']} width {st['width']}, acceptance {st['acceptance']:.2f}, "
              f"{st['tokens_per_s']:.1f} tok/s, KV {st['kv_bytes'] / 2**20:.1f} MiB")
        if trace:
            label = (lambda t: repr(model.tokenizer.decode([t]))) if model.tokenizer else str
            print(draw_wavefront(trace, out.tokens, len(prompt), st["num_steps"], st["draft_steps"], label))
    if len(methods) > 1 and not args.json:
        same = lambda a, b: a.tokens == b.tokens and torch.equal(torch.stack(a.logits), torch.stack(b.logits))
        exact = same(results["wfd"], results["ar"]) and same(results["dtv"], results["ar-dtv"])
        print("outputs identical to AR at the same width (tokens and logits): " + ("yes" if exact else "NO"))
        plain = results["ar1"]
        for method, r in results.items():
            match = sum(a == b for a, b in zip(r.tokens, plain.tokens)) / max(len(r.tokens), len(plain.tokens))
            print(f"  {method:>6}: width {r.stats['width']}, {r.stats['tokens_per_s'] / plain.stats['tokens_per_s']:.2f}x "
                  f"plain AR, {r.stats['r_calls_per_token']:.2f} R calls/token, {100 * match:.0f}% of plain AR's tokens")


if __name__ == "__main__":
    main()
