"""Prompts as token ids, and the stop ids that go with them: run.py's (--prompt, --prompt-ids,
--prompts-file, raw or as a chat turn) and bench.py's prompt sets (Spec-Bench's questions, held-out
standard-library code, random ids). Every source adds what the family's tokenizer needs (Parcae's
<|bos|>)."""
import contextlib
import json
import random
import re
from collections import defaultdict

from cli.args import naming
from data import stdlib
from formats import chat
from formats.checkpoints import tokenizer_stop_ids

def id_list(flag, text):
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers such as 1,2,3, "
                         f"not {text!r}") from None


def eos_flag(args, model):
    """--eos's ids, each in the vocabulary."""
    ids = id_list("--eos", args.eos)
    bad = [t for t in ids if not 0 <= t < model.args.vocab_size]
    if bad:
        raise ValueError(f"--eos {bad[0]} is outside the vocabulary "
                         f"(0..{model.args.vocab_size - 1})")
    return ids


def default_eos(model):
    """The checkpoint's stop ids; where its configs name none, the tokenizer's (LoopFormer's and the
    retrofits': its eos_token or <|endoftext|>; Parcae's: <|eos|>)."""
    if model.eos_token_ids or model.tokenizer is None:
        return model.eos_token_ids
    if not model.args.config_stop_ids:
        return tokenizer_stop_ids(model)
    eos = model.tokenizer.token_to_id("<|eos|>")
    return () if eos is None else (eos,)


def read_prompt(args, model):
    """(prompt ids, stop ids): --eos where given, else the checkpoint's (and with --chat its end
    of turn)."""
    if args.prompt_ids is not None:
        prompt, eos = id_list("--prompt-ids", args.prompt_ids), default_eos(model)
    else:
        prompt, eos = text_prompt(args, model, args.prompt)
    return prompt, eos if args.eos is None else eos_flag(args, model)


def text_prompt(args, model, text):
    """A text's ids, raw or with --chat as one user turn, and the stop ids that go with them."""
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json: pass --tokenizer, or --prompt-ids "
                         "instead of --prompt (in a prompts file, .jsonl lines with prompt_ids)")
    return (chat.chat_prompt(model, text) if args.chat
            else (encode_text(model, text), default_eos(model)))


SURROGATE = r"[\ud800-\udfff]"  # half of a UTF-16 pair: no character alone
NEWLINE = r"\r\n|\r|\n"  # a file's lines end as Python's text files read them


def text_of_bytes(data):
    """UTF-8 bytes as text, a leading byte-order mark dropped (an editor's, not the prompt's). A
    byte that is not UTF-8 is refused, naming it, its offset and its line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"line {line}: not UTF-8 text (byte {data[err.start]:#04x} at offset "
                         f"{err.start})") from None
    return text.removeprefix("\ufeff")


def checked_text(text):
    """text, refused where it holds a lone surrogate (a JSON escape such as \\ud800 makes one): no
    tokenizer takes one."""
    bad = re.search(SURROGATE, text)
    if bad:
        raise ValueError(f"the prompt holds U+{ord(bad.group()):04X}, a lone surrogate, which is "
                         "not text")
    return text


def check_argument_text(flag, text):
    """A text typed on the command line refused where Python kept a byte of it that is not UTF-8
    as the lone surrogate U+DC00 + byte (surrogateescape), naming the byte."""
    bad = re.search(SURROGATE, text)
    if bad:
        raise ValueError(f"{flag}: not UTF-8 text (byte {ord(bad.group()) - 0xDC00:#04x} at "
                         f"character {bad.start()})")


def file_text(flag, path):
    """A prompt file's text (text_of_bytes), its mistakes named by the flag and the file."""
    with naming(flag, path), open(path, "rb") as f:
        data = f.read()
    try:
        return text_of_bytes(data)
    except ValueError as err:
        raise ValueError(f"{flag} {path} {err}") from None


def file_line(args, line, jsonl):
    """One line of --prompts-file, read before the model loads: its text, or its token ids."""
    if not jsonl:
        return checked_text(line)
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    keys = {"prompt", "prompt_ids"} & set(obj) if isinstance(obj, dict) else set()
    if len(keys) != 1:
        raise ValueError('each line must be a JSON object with "prompt" (text) or "prompt_ids" '
                         '(token ids), one of them')
    if "prompt" in keys:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        return checked_text(obj["prompt"])
    ids = obj["prompt_ids"]
    if args.chat:
        raise ValueError("--chat formats text prompts: it cannot take prompt_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise ValueError('"prompt_ids" must be a list of integers')
    return ids


def prompt_lines(args):
    """run.py's prompts as the user typed them, before the model loads, so that a mistake in them
    is refused first: --prompt checked to be text (check_argument_text), --prompt-ids and --eos
    to be integers, and --prompts-file's lines, each (line number, its text or its ids). Lines of
    a .jsonl file are JSON objects; of any other file, prompt texts. Blank lines are skipped."""
    if args.prompt is not None:
        check_argument_text("--prompt", args.prompt)
    if args.chat and args.prompt_ids is not None:
        raise ValueError("--chat formats a --prompt text: it cannot take --prompt-ids")
    for flag, ids in (("--prompt-ids", args.prompt_ids), ("--eos", args.eos)):
        if ids is not None:
            id_list(flag, ids)  # read again once the model's vocabulary can check them
    if args.prompts_file is None:
        return None
    lines, jsonl = [], args.prompts_file.endswith(".jsonl")
    text = file_text("--prompts-file", args.prompts_file)
    for n, line in enumerate(re.split(NEWLINE, text), 1):
        if line.strip():
            with line_named(args.prompts_file, n):
                lines.append((n, file_line(args, line, jsonl)))
    if not lines:
        raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt (blank lines are "
                         "skipped)")
    return lines


@contextlib.contextmanager
def line_named(path, n):
    """A mistake in a prompts file's line n, named by the flag, the file and the line."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"--prompts-file {path} line {n}: {err}") from None


def read_prompts(args, model, lines):
    """--prompts-file's lines (prompt_lines) as (line numbers, prompts' ids, stop ids: --eos, else
    the prompts' own)."""
    prompts, eos = [], set()
    for n, line in lines:
        with line_named(args.prompts_file, n):
            ids, stop = (text_prompt(args, model, line) if isinstance(line, str)
                         else (line, default_eos(model)))
        prompts.append(ids)
        eos.update(stop or ())  # one model, one format: every prompt brings the same stop ids
    return ([n for n, _ in lines], prompts,
            sorted(eos) if args.eos is None else eos_flag(args, model))


def encode_text(model, text):
    """A raw-text prompt's ids. Parcae's tokenizer adds no special token itself, and its models read
    text after <|bos|>."""
    bos = model.tokenizer.token_to_id("<|bos|>") if model.kind == "parcae" else None
    return [bos] * (bos is not None) + model.tokenizer.encode(text).ids



def read_questions(path, categories, per_category):
    """Spec-Bench question.jsonl's first turns, (question id, category, text) each, of the
    categories asked for (all if None), at most per_category of each. It needs no model: bench.py
    reads it first to refuse its mistakes before the model loads."""
    questions, taken, seen = [], defaultdict(int), set()
    for n, line in enumerate(re.split(NEWLINE, file_text("--questions", path)), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            cat, turn = q["category"], q["turns"][0].strip()
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            raise ValueError(f"--questions {path} line {n} is not a Spec-Bench question "
                             f"({type(err).__name__}: {err})") from None
        try:
            checked_text(turn)
        except ValueError as err:
            raise ValueError(f"--questions {path} line {n}: {err}") from None
        seen.add(cat)
        if (categories and cat not in categories) or (per_category and taken[cat] >= per_category):
            continue
        taken[cat] += 1
        questions.append((q["question_id"], cat, turn))
    unknown = sorted(set(categories or ()) - seen)
    if unknown:
        raise ValueError(f"--categories {unknown[0]}: no question of {path} has it; its "
                         f"categories: {', '.join(sorted(seen))}")
    return questions


def specbench_prompts(model, path, categories, per_category, as_chat):
    """Spec-Bench question.jsonl, first turn only (read_questions): as text, or as_chat one user
    turn in the model's chat format (chat.chat_prompt, with enable_thinking as the official
    protocol renders it)."""
    if model.tokenizer is None:
        raise ValueError("--questions needs the model's tokenizer.json")
    prompts = []
    for question_id, cat, turn in read_questions(path, categories, per_category):
        ids, eos = (chat.chat_prompt(model, turn, enable_thinking=True) if as_chat else
                    (encode_text(model, turn), default_eos(model)))
        prompts.append(dict(question_id=question_id, category=cat, ids=ids, eos=eos))
    return prompts


def stdlib_prompts(model, per_file, length=48):
    """The demo's held-out set: the first `length` tokens from each of the first `per_file`
    top-level defs of every held-out stdlib library file (demo/train.py never trains on them; its
    own evaluation uses the first def of each)."""
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer.json: use --num-prompts (random token ids) "
                         "or --questions")
    prompts = []
    for rel, text in stdlib.library_split()[1]:
        for m in list(re.finditer(r"^def ", text, re.M))[:per_file]:
            prompts.append(dict(question_id=f"{rel}:{text.count(chr(10), 0, m.start()) + 1}",
                                category="stdlib",
                                ids=encode_text(model, text[m.start():])[:length],
                                eos=default_eos(model)))
    return prompts


def random_prompts(model, n, length, seed):
    """Seeded random token ids, for models without a tokenizer; no EOS, so each runs to
    the limit."""
    g = random.Random(seed)
    return [dict(question_id=i, category="random", eos=None,
                 ids=[g.randrange(model.args.vocab_size) for _ in range(length)]) for i in range(n)]
