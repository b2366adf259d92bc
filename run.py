"""Generate with a looped LM: python run.py --prompt "def fib(n):" [--model FOLDER_OR_HUB_ID] ...

Without --model it runs the small demo model that ships in demo/ (see train_demo.py). Many prompts,
decoded together: python run.py --prompts-file prompts.txt --batch-size 4 (one prompt per line, or a
.jsonl file with one {"prompt": TEXT} or {"prompt_ids": [IDS]} per line); each answer prints as its
prompt finishes."""
import argparse
import functools
import json
import math
import os
import sys
import time

import torch

import chat
import checks
import models
import wfd

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


TOKENIZER_HELP = ("tokenizer.json, or a folder or hub id holding one, for a model whose folder has none "
                  "(Parcae: SandyResearch/parcae-tokenizer)")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other error of the command line (no usage block)
        self.exit(2, f"error: {message}\n")


def one_line_errors(main):
    """main, with every error in the user's input (arguments, files, configs, weights, devices, the hub:
    the ValueErrors and OSErrors this project raises for them) and running out of memory reported as
    one line on stderr and exit status 2, and Ctrl-C as one line and status 130. Any other exception is
    a bug, and keeps its traceback."""
    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except (ValueError, OSError) as err:
            print("error: " + " ".join(str(err).split()), file=sys.stderr)
            sys.exit(2)
        except RuntimeError as err:
            if not out_of_memory(err):
                raise
            print("error: out of memory: " + " ".join(str(err).split("\n")[0].split())[:300] + "; try a smaller "
                  "--batch-size, --max-new-tokens or --capacity, --kv shared, or a smaller --dtype", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt as err:
            print(str(err) or "interrupted", file=sys.stderr)
            sys.exit(130)
    return wrapped


def out_of_memory(err):
    """A RuntimeError that is torch running out of device memory (CUDA's OutOfMemoryError) or host
    memory (the CPU allocator's)."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def check_at_least(args, **least):
    """Refuse a count below its minimum (--threads -2 and the like) before any work starts."""
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, not {value}")


def add_decoding_args(p, seed_help, dtype_help, compile_help):
    """The flags run.py and bench.py share: depths, drafts, precision, threads, compiling, sampling."""
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, help="full depth T (default: the model's)")
    p.add_argument("--draft-steps", type=int, help="draft depth k (default: the config's wfd_draft_steps, "
                   "else max(1, T // 8))")
    p.add_argument("--draft-len", type=int, default=4, help="drafts per draft-then-verify round")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help=dtype_help)
    p.add_argument("--threads", type=int, help="CPU threads (default: 1 for models under 100M parameters, "
                   "whose matmuls are too small to share between cores; else torch's default)")
    p.add_argument("--compile", action="store_true", help="run the P, R and C calls after the prefill "
                   "compiled by torch.compile (on CUDA as CUDA graphs); " + compile_help)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample "
                   "(every method gives AR's sampled tokens with the same seed)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the most likely tokens that reach probability p")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO, help="model folder or Hugging Face hub id (default: the demo model)")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", metavar="FILE", help="many prompts, decoded together: one text per line "
                     "(blank lines skipped), or a .jsonl file with one object per line holding \"prompt\" (text) "
                     "or \"prompt_ids\" (token ids)")
    p.add_argument("--batch-size", type=int, help="with --prompts-file: the sequences decoded together (default: "
                   "every prompt); a finished sequence's slot takes the next prompt")
    p.add_argument("--method", default="wfd", choices=["wfd", "ar", "dtv", "all"])
    p.add_argument("--width", type=int, help="rows per call (default: ceil(T / k) for wfd and ar, draft-len + 1 "
                   "for dtv); --method ar --width 1 is plain decoding")
    p.add_argument("--kv", default="full", choices=["full", "shared"], help="KV cache: per depth, or shared across depths")
    add_decoding_args(p, seed_help="the run's randomness: the sampling noise and Huginn's and Parcae's random initial state",
                      dtype_help="default: the checkpoint's", compile_help="a short run of each method compiles them")
    p.add_argument("--state-init", default="random", choices=["random", "zero"], help="Huginn's and Parcae's initial state")
    p.add_argument("--chat", action="store_true", help="wrap --prompt (or each text prompt) as one user turn in the "
                   "checkpoint's chat template (tokenizer_config.json; else its family's format) and stop at the end "
                   "of the turn too")
    p.add_argument("--eos", help="stop token ids, comma-separated, '' for none (default: generation_config.json's "
                   "eos_token_id, else config.json's, else the tokenizer's <|eos|>; with --chat also the template's "
                   "end-of-turn token)")
    p.add_argument("--json", action="store_true", help="print one JSON object per method (prompt_ids, tokens, text, "
                   "stats) instead of text; with --prompts-file one per prompt, with its index")
    p.add_argument("--show-wavefront", action="store_true", help="draw the (position x depth) schedule of the first ticks")
    return p.parse_args(argv)


def id_list(flag, text):
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers such as 1,2,3, not {text!r}") from None


def default_eos(model):
    """The checkpoint's stop ids, else the tokenizer's <|eos|> (Parcae's configs name none)."""
    eos = None if model.eos_token_ids or model.tokenizer is None else model.tokenizer.token_to_id("<|eos|>")
    return model.eos_token_ids if eos is None else (eos,)


def read_prompt(args, model):
    """(prompt ids, stop ids): --eos where given, else the checkpoint's (and with --chat its end of turn)."""
    if args.chat and args.prompt is None:
        raise ValueError("--chat formats a --prompt text: it cannot take --prompt-ids")
    if args.prompt_ids is not None:
        prompt, eos = id_list("--prompt-ids", args.prompt_ids), default_eos(model)
    else:
        prompt, eos = text_prompt(args, model, args.prompt)
    return prompt, eos if args.eos is None else id_list("--eos", args.eos)


def text_prompt(args, model, text):
    """A text's ids, raw or with --chat as one user turn, and the stop ids that go with them."""
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: pass --tokenizer, or --prompt-ids instead of "
                         "--prompt (in a prompts file, .jsonl lines with prompt_ids)")
    return chat.chat_prompt(model, text) if args.chat else (encode_text(model, text), default_eos(model))


def file_prompt(args, model, line, jsonl):
    """One line of --prompts-file: (ids, stop ids)."""
    if not jsonl:
        return text_prompt(args, model, line.rstrip("\r\n"))
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    keys = {"prompt", "prompt_ids"} & set(obj) if isinstance(obj, dict) else set()
    if len(keys) != 1:
        raise ValueError('each line must be a JSON object with "prompt" (text) or "prompt_ids" (token ids), '
                         'one of them')
    if "prompt" in keys:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        return text_prompt(args, model, obj["prompt"])
    ids = obj["prompt_ids"]
    if args.chat:
        raise ValueError("--chat formats text prompts: it cannot take prompt_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError('"prompt_ids" must be a list of integers')
    return ids, default_eos(model)


def read_prompts(args, model):
    """--prompts-file: (line numbers, prompts' ids, stop ids: --eos, else the prompts' own). Lines of a
    .jsonl file are JSON objects; of any other file, prompt texts. Blank lines are skipped."""
    lines, prompts, eos = [], [], set()
    with open(args.prompts_file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids, stop = file_prompt(args, model, line, args.prompts_file.endswith(".jsonl"))
            except ValueError as err:
                raise ValueError(f"{args.prompts_file} line {n}: {err}") from None
            lines.append(n)
            prompts.append(ids)
            eos.update(stop or ())  # one model, one format: every prompt brings the same stop ids
    if not prompts:
        raise ValueError(f"{args.prompts_file} holds no prompt (blank lines are skipped)")
    return lines, prompts, sorted(eos) if args.eos is None else id_list("--eos", args.eos)


def encode_text(model, text):
    """A raw-text prompt's ids. Parcae's tokenizer adds no special token itself, and its models read
    text after <|bos|>."""
    bos = model.tokenizer.token_to_id("<|bos|>") if model.kind == "parcae" else None
    return [bos] * (bos is not None) + model.tokenizer.encode(text).ids


def answer_text(tokenizer, tokens, stop_token):
    """The text of an answer: every token the model wrote, special ones included (a Thinking model's
    <think> markers), as transformers decodes, but the stop token that ended it."""
    return tokenizer.decode(tokens[:-1] if stop_token is not None else tokens, skip_special_tokens=False)


class TextStream:
    """Prints the prompt, then the text of each token as it commits (special tokens included, the stop
    token left out, as answer_text), decoding only the tokens since the last text printed (from the
    one before, for context): a long answer costs the same per token as a short one. A character
    whose bytes span several tokens decodes to U+FFFD until its last byte arrives, so a piece ending in
    U+FFFD waits for the next token; at the end the whole text is out, exactly the decode of every
    token (of a byte-level tokenizer, as Ouro's and Huginn's are)."""

    def __init__(self, tokenizer, prompt, stop=()):
        self.tokenizer, self.ids, self.stop = tokenizer, list(prompt), set(stop)
        self.start = self.done = 0  # ids[start:done]: printed already, decoded again as context
        self.show(final=False)

    def add(self, token):
        if token in self.stop:  # the last token: it ends the answer and is not part of its text
            return
        self.ids.append(token)
        self.show(final=False)

    def show(self, final=True):
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        before = decode(self.ids[self.start:self.done])
        text = decode(self.ids[self.start:])
        if final or not text.endswith("\ufffd"):
            print(text[len(before):], end="\n" if final else "", flush=True)
            self.start, self.done = self.done, len(self.ids)


def finite(stats):
    """The stats with NaN and inf as None: strict JSON has no NaN (AR's acceptance is undefined)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in stats.items()}


def token_match(tokens, reference):
    """The share of positions where tokens equal the reference's, over the longer of the two."""
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(tokens), len(reference))


def stats_line(method, stats):
    acceptance = "-" if math.isnan(stats["acceptance"]) else f"{stats['acceptance']:.2f}"
    kv = f" (shared, window {stats['window']})" if stats["kv"] == "shared" else ""
    peak = "" if stats["peak_memory_bytes"] is None else f", peak memory {stats['peak_memory_bytes'] / 2**30:.2f} GiB"
    stop = "" if stats["stop_token"] is None else f", stopped at token {stats['stop_token']}"
    return (f"[{method}] {stats['tokens']} tokens, {stats['r_calls']} R calls ({stats['r_calls_per_token']:.2f}/token), "
            f"T={stats['num_steps']} k={stats['draft_steps']} width {stats['width']}, acceptance {acceptance}, "
            f"{stats['tokens_per_s']:.1f} tok/s, KV {stats['kv_bytes'] / 2**20:.1f} MiB{kv}{peak}{stop}")


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


def text_of(tok, out):
    return answer_text(tok, out.tokens, out.stats["stop_token"]) if tok else out.tokens


def json_line(name, prompt, out, tok, **extra):
    """One generation as strict JSON: the method, extra (a prompts file's index), the prompt's ids, the
    new tokens, their text and the stats."""
    return json.dumps(dict(method=name, **extra, prompt_ids=prompt, tokens=out.tokens,
                           text=text_of(tok, out) if tok else None, stats=finite(out.stats)), allow_nan=False)


def compile_runs(model, prompts, runs, settings, args, batch_size=None):
    """--compile: every graph the runs will meet compiled before they run (wfd.compile_graphs), at one KV
    capacity, that of the longest prompt (prompts: one prompt, or a file's, decoded together)."""
    longest = max(map(len, prompts)) if isinstance(prompts[0], list) else len(prompts)
    settings["capacity"] = longest + args.max_new_tokens - 1
    shape = {k: v for k, v in settings.items() if k not in ("seed", "compile")}
    for _, method, width in runs:
        wfd.compile_graphs(model, prompts, args.max_new_tokens, method=method, width=width, batch_size=batch_size,
                           **shape)


def decode_file(args, model, method, width, settings):
    """--prompts-file: every prompt through --batch-size slots, each answer printed as its prompt finishes."""
    lines, prompts, eos = read_prompts(args, model)
    for n, prompt in zip(lines, prompts):  # a prompt's mistake named by its line, before any output
        try:
            checks.check_args(model, prompt, args.max_new_tokens, method=method, width=width, eos_token_id=eos, **settings)
        except ValueError as err:
            raise ValueError(f"{args.prompts_file} line {n}: {err}") from None
    checks.check_args(model, prompts, args.max_new_tokens, method=method, width=width, eos_token_id=eos,
                   batch_size=args.batch_size, **settings)
    slots, tok = min(args.batch_size or len(prompts), len(prompts)), model.tokenizer  # as generate's
    if args.compile:
        compile_runs(model, prompts, [(method, method, width)], settings, args, args.batch_size)

    def finish(i, out):
        if args.json:
            print(json_line(method, prompts[i], out, tok, index=i), flush=True)
        else:
            print(f"[prompt {i}] {text_of(tok, out)}")
            print(stats_line(f"{method}, prompt {i}, slot {out.stats['slot']}", out.stats), flush=True)

    t0 = time.perf_counter()
    outs = wfd.generate(model, prompts, args.max_new_tokens, method=method, width=width, eos_token_id=eos,
                        batch_size=args.batch_size, on_finish=finish, **settings)
    wall, tokens = time.perf_counter() - t0, sum(len(out.tokens) for out in outs)
    if not args.json:
        print(f"[{method}] {len(prompts)} prompts through {slots} slots: {tokens} tokens in {wall:.2f} s, "
              f"{tokens / wall:.1f} tok/s")


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    check_at_least(args, threads=1, batch_size=1)
    if args.batch_size is not None and args.prompts_file is None:
        raise ValueError("--batch-size needs --prompts-file: one prompt decodes alone")
    if args.prompts_file is not None and (args.method == "all" or args.show_wavefront):
        raise ValueError("--prompts-file decodes with one method, without --show-wavefront: for --method all on "
                         "many prompts use bench.py (--batch-size)")
    if args.model == DEMO and not os.path.isdir(DEMO):
        raise FileNotFoundError("no --model given and the demo model is missing: build it with python train_demo.py")
    tokenizer = args.tokenizer and models.load_tokenizer(args.tokenizer)  # before the weights: it fails quicker
    model = models.load(args.model, device=args.device, dtype=DTYPES.get(args.dtype),
                        state_init=args.state_init, seed=args.seed)
    model.tokenizer = tokenizer or model.tokenizer
    models.set_threads(model, args.threads)
    settings = dict(num_steps=args.steps, draft_steps=args.draft_steps, draft_len=args.draft_len, kv=args.kv,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    compile=args.compile)
    if args.prompts_file is not None:
        return decode_file(args, model, args.method, args.width, settings)
    (prompt, eos), tok = read_prompt(args, model), model.tokenizer
    # (name, method, width); all: plain AR (the speed baseline), and each schedule after AR at its
    # width, its exact reference
    runs = ([("ar1", "ar", 1), ("ar", "ar", args.width), ("wfd", "wfd", args.width),
             ("ar-dtv", "ar", args.draft_len + 1), ("dtv", "dtv", None)] if args.method == "all"
            else [(args.method, args.method, args.width)])
    if args.kv == "shared" and args.method == "all":
        runs = runs[:3]
        print("note: skipping dtv, which cannot share KV exactly (its verify pass writes final-depth KV "
              "of positions it may reject)", file=sys.stderr)
    for _, method, width in runs:  # every input error out before the first line of output
        checks.check_args(model, prompt, args.max_new_tokens, method=method, width=width, eos_token_id=eos, **settings)
    if args.compile:
        compile_runs(model, prompt, runs, settings, args)
    stream = not args.json and len(runs) == 1 and tok is not None
    results = {}
    for name, method, width in runs:
        text = TextStream(tok, prompt, checks.stop_ids(eos, model.args.vocab_size)) if stream else None
        trace = [] if args.show_wavefront and method == "wfd" else None
        out = wfd.generate(model, prompt, args.max_new_tokens, method=method, width=width, eos_token_id=eos,
                           on_token=text.add if text else None, trace=trace, digest_logits=len(runs) > 1, **settings)
        results[name] = out
        stats = out.stats
        if args.json:
            print(json_line(name, prompt, out, tok))
            continue
        if text:
            text.show()
        else:
            print(f"[{method}] {text_of(tok, out)}")
        print(stats_line(name, stats))
        if trace:
            label = (lambda t: repr(tok.decode([t]))) if tok else str
            print(draw_wavefront(trace, out.tokens, len(prompt), stats["num_steps"], stats["draft_steps"], label))
    if len(runs) > 1 and not args.json:
        same = lambda a, b: a.tokens == b.tokens and a.stats["logits_digest"] == b.stats["logits_digest"]
        exact = all(same(results[a], results[b]) for a, b in (("wfd", "ar"), ("dtv", "ar-dtv")) if a in results)
        print("outputs identical to AR at the same width (tokens and logits): " + ("yes" if exact else "NO"))
        plain = results["ar1"]
        for method, r in results.items():
            match = token_match(r.tokens, plain.tokens)
            print(f"  {method:>6}: width {r.stats['width']}, {r.stats['tokens_per_s'] / plain.stats['tokens_per_s']:.2f}x "
                  f"plain AR, {r.stats['r_calls_per_token']:.2f} R calls/token, {100 * match:.0f}% of plain AR's tokens")


if __name__ == "__main__":
    main()
