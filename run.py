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
    p.add_argument("--draft-steps", type=int, help="draft depth k (default: max(1, T // 8))")
    p.add_argument("--draft-len", type=int, default=4, help="drafts per draft-then-verify round")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv", default="full", choices=["full", "shared"], help="KV cache: per depth, or shared across depths")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    p.add_argument("--seed", type=int, default=0, help="seed of Huginn's random initial state")
    p.add_argument("--state-init", default="random", choices=["random", "zero"], help="Huginn's initial state")
    p.add_argument("--eos", type=int, help="stop token id (default: the config's eos_token_id)")
    p.add_argument("--json", action="store_true", help="print one JSON object per method instead of text")
    p.add_argument("--show-wavefront", action="store_true", help="draw the (position x depth) schedule of the first ticks")
    return p.parse_args(argv)


def default_eos(model):
    eos = model.config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


def draw_wavefront(trace, first_pos, ticks=24):
    """One line per position, one column per R call: the depth a row reached in that call, with
    d = drafted from here, + = its draft accepted, x = rejected (the rows after it are dropped)."""
    trace = trace[:ticks]
    positions = sorted({p for t in trace for p, _ in t["rows"]})
    lines = ["pos   " + "".join(f"{i + 1:>4}" for i in range(len(trace))) + "   (R call)"]
    for pos in positions:
        cells = []
        for t in trace:
            depth = dict(t["rows"]).get(pos)
            mark = ("x" if t.get("rejected") == pos + 1 else "+" if t.get("accepted") == pos + 1
                    else "d" if t.get("drafted") == pos + 1 else " ")
            cells.append(f"{depth:>3}{mark}" if depth is not None else "   .")
        lines.append(f"{pos - first_pos:>+4}  " + "".join(cells))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.model == DEMO and not os.path.isdir(DEMO):
        sys.exit("no --model given and the demo model is missing: build it with python train_demo.py")
    model = models.load(args.model, device=args.device, dtype=DTYPES.get(args.dtype),
                        state_init=args.state_init, seed=args.seed)
    if args.prompt_ids is not None:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif model.tokenizer is None:
        sys.exit(f"{args.model} has no tokenizer.json: pass --prompt-ids instead of --prompt")
    else:
        prompt = model.tokenizer.encode(args.prompt).ids
    eos = args.eos if args.eos is not None else default_eos(model)
    methods = ["ar", "dtv", "wfd"] if args.method == "all" else [args.method]
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
        out = wfd.generate(model, prompt, args.max_new_tokens, method=method, num_steps=args.steps,
                           draft_steps=args.draft_steps, draft_len=args.draft_len, eos_token_id=eos,
                           kv=args.kv, on_token=on_token, trace=trace)
        results[method] = out
        st = out.stats
        if args.json:
            print(json.dumps(dict(tokens=out.tokens, **st)))
            continue
        if stream:
            print()
        elif model.tokenizer is not None:
            print(f"[{method}] {model.tokenizer.decode(out.tokens)}")
        else:
            print(f"[{method}] {out.tokens}")
        print(f"[{method}] {st['tokens']} tokens, {st['r_calls']} R calls ({st['r_calls_per_token']:.2f}/token), "
              f"T={st['num_steps']} k={st['draft_steps']}, acceptance {st['acceptance']:.2f}, "
              f"{st['tokens_per_s']:.1f} tok/s, KV {st['kv_bytes'] / 2**20:.1f} MiB")
        if trace:
            print(draw_wavefront(trace, len(prompt)))
    if len(methods) > 1 and not args.json:
        same = all(r.tokens == results["ar"].tokens for r in results.values())
        print("outputs identical to AR: " + ("yes" if same else "NO"))
        for method, r in results.items():
            print(f"  {method:>3}: {r.stats['tokens_per_s'] / results['ar'].stats['tokens_per_s']:.2f}x AR "
                  f"({r.stats['r_calls_per_token']:.2f} R calls/token)")


if __name__ == "__main__":
    main()
