"""What the commands print: an answer's text (streamed as it commits), the stats line, strict JSON,
and the wavefront's picture."""
import json
import math

def answer_text(tokenizer, tokens, stop_token):
    """The text of an answer: every token the model wrote, special ones included (a Thinking model's
    <think> markers), as transformers decodes, but the stop token that ended it."""
    return tokenizer.decode(tokens[:-1] if stop_token is not None else tokens,
                            skip_special_tokens=False)


class TextStream:
    """Prints the prompt, then the text of each token as it commits (special tokens included, the
    stop token left out, as answer_text), decoding only the tokens since the last text printed (from
    the one before, for context): a long answer costs the same per token as a short one. A character
    whose bytes span several tokens decodes to U+FFFD until its last byte arrives, so a piece ending
    in U+FFFD waits for the next token; at the end the whole text is out, exactly the decode of
    every token (of a byte-level tokenizer, as Ouro's and Huginn's are)."""

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
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in stats.items()}


def token_match(tokens, reference):
    """The share of positions where tokens equal the reference's, over the longer of the two."""
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(tokens), len(reference))


def stats_line(method, stats):
    acceptance = "-" if math.isnan(stats["acceptance"]) else f"{stats['acceptance']:.2f}"
    kv = f" (shared, window {stats['window']})" if stats["kv"] == "shared" else ""
    peak = ("" if stats.get("peak_memory_bytes") is None  # the engine's on CUDA
            else f", peak memory {stats['peak_memory_bytes'] / 2**30:.2f} GiB")
    width = f" width {stats['width']}" if "width" in stats else ""  # the engine's lanes
    stop = "" if stats["stop_token"] is None else f", stopped at token {stats['stop_token']}"
    second = ("" if stats.get("second_depth") is None else
              f", second depth m={stats['second_depth']}: {stats['rescued']} rescues")
    return (f"[{method}] {stats['tokens']} tokens, {stats['r_calls']} R calls "
            f"({stats['r_calls_per_token']:.2f}/token), T={stats['num_steps']} "
            f"k={stats['draft_steps']}{width}, acceptance {acceptance}{second}, "
            f"{stats['tokens_per_s']:.1f} tok/s, KV "
            f"{stats['kv_bytes'] / 2**20:.1f} MiB{kv}{peak}{stop}")


def draw_wavefront(trace, tokens, first_pos, num_steps, k, label, ticks=24, second_depth=None):
    """The (position x depth) picture of the first R calls of a WFD run: one column per R call, one
    line per row (a position, named by the token it reads in; a rejected draft, its sibling and
    the row that replaces them get a line each), the cell holding the depth the row reached in that
    call and what happened to it (the legend). tokens: the committed tokens."""
    trace = trace[:ticks]
    width = len(str(num_steps)) + 4
    lines, marks = {}, ("accepted", "rescued", "rejected", "drafted", "proposed")
    keys = row_lines(trace)  # tick -> row id -> its line
    for t, tick in enumerate(trace):
        later = set(keys[t + 1].values()) if t + 1 < len(trace) else None
        note = {what: set(tick.get(what, ())) for what in marks}
        for pos, depth, rid, token in tick["rows"]:
            at = pos - first_pos  # p: the first new token's position, as in wfd.py's trace
            line = lines.setdefault(keys[t][rid], dict(
                name=f"{'p' if at == 0 else f'p+{at}':<5} {label(token)}", cells={}))
            dropped = (later is not None and keys[t][rid] not in later and depth < num_steps
                       and rid not in note["rejected"])
            verdict = ("+" if rid in note["accepted"] else "^" if rid in note["rescued"] else
                       "x" if rid in note["rejected"] else "-" if dropped else "")
            mark = (("=" if depth == num_steps else "") + verdict
                    + ("d" if rid in note["drafted"] else "") + ("s" if rid in note["proposed"]
                                                                 else ""))
            line["cells"][t] = f"{depth}{mark}"
    name_w = max(len(line["name"]) for line in lines.values())
    out = [" " * name_w + "  R call " + "".join(f"{t + 1:>{width}}" for t in range(len(trace)))]
    for line in lines.values():
        cells = "".join(f"{line['cells'].get(t, ''):>{width}}" for t in range(len(trace)))
        out.append(f"{line['name']:<{name_w}}         {cells}".rstrip())
    committed = sum(1 for tick in trace for pos, depth, _, _ in tick["rows"] if depth == num_steps)
    out += ["One column per R call (the looped block run once over a batch of rows), "
            "one line per row:",
            "a new token's position (p: the prompt's length), named by the token it reads in. The",
            "number is the depth that row reached in that call.",
            f"  d  read at the draft depth k={k}: its token is a draft, "
            "and the next position starts at once",
            f"  =  read at the full depth T={num_steps}: AR's token, committed; "
            "it checks the draft of the next line",
            "  +  this row's draft was checked and accepted",
            "  x  this row's draft was rejected: "
            "the row is dropped (- and the rows drafted from it), and the",
            "     position starts again from depth 1 with the committed token"]
    if second_depth is not None:
        out += [f"  s  read again at the second depth m={second_depth}: its token differs from "
                "the draft, and starts",
                "     a sibling row at the next position (a line of its own)",
                "  ^  this row, a sibling, carried the committed token: a rescue (its draft "
                "sibling is dropped)"]
    out.append(f"{committed} tokens committed in {len(trace)} R calls; "
               f"AR takes {num_steps} R calls per token.")
    return "\n".join(out)


def row_lines(trace):
    """Each tick's rows as lines of the picture: per tick, the row's identity -> its line. A trace
    names a row by its object's id(), which Python gives again to a later object once the row is
    gone, so a row goes on the line it had in the tick before only where it is at the same
    position and deeper; else it is a new row, on a line of its own."""
    keys, before, count = [], {}, 0
    for tick in trace:
        now = {}
        for pos, depth, rid, _ in tick["rows"]:
            line, was_pos, was_depth = before.get(rid, (None, None, None))
            if line is None or was_pos != pos or was_depth >= depth:
                line, count = count, count + 1
            now[rid] = (line, pos, depth)
        keys.append({rid: line for rid, (line, _, _) in now.items()})
        before = now
    return keys


def text_of(tok, out):
    return answer_text(tok, out.tokens, out.stats["stop_token"]) if tok else out.tokens


def json_line(name, prompt, out, tok, **extra):
    """One generation as strict JSON: the method, extra (a prompts file's index), the prompt's ids,
    the new tokens, their text and the stats."""
    return json.dumps(dict(method=name, **extra, prompt_ids=prompt, tokens=out.tokens,
                           text=text_of(tok, out) if tok else None, stats=finite(out.stats)),
                      allow_nan=False)
