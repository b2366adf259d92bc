"""bench.py's answer files: one JSONL per method in Spec-Bench's answer format, written as the
prompts finish, and read back to resume a run cut short; the run's fingerprint, which its sweeps
carry too; and the check that --out holds no earlier run's files, made before the model loads."""
import hashlib
import json
import os
import sys
import time
import uuid

from cli.output import answer_text, finite


def fingerprint(model_id, args):
    """The run's identity: the model and its flags but --resume, --overwrite and --out, which say
    where its results go and what to do with earlier ones, not what it measures."""
    flags = {k: v for k, v in sorted(vars(args).items())
             if k not in ("resume", "overwrite", "out")}
    return hashlib.blake2b(json.dumps([model_id, flags], default=str).encode(),
                           digest_size=8).hexdigest()


def check_out(args, model_id, names):
    """--out refused before any work where it is a file, or holds the answers (or with --sweep
    NAME, the sweep-NAME.json) of an earlier run and neither --resume nor --overwrite says what
    to do with them."""
    if not args.out:
        return
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file: give a folder (made if missing) for the "
                         f"{'sweep' if args.sweep else 'answers'}")
    files = ([f"sweep-{args.sweep}.json"] if args.sweep
             else [f"{model_id}-{n}.jsonl" for n in names])
    earlier = [f for f in files if os.path.isfile(os.path.join(args.out, f))
               and os.path.getsize(os.path.join(args.out, f))]
    if earlier and not (args.resume or args.overwrite):
        what = "a sweep" if args.sweep else "the answers"
        raise ValueError(f"--out {args.out} holds {what} of an earlier run ({earlier[0]}): "
                         "--resume goes on with it, --overwrite starts again, or give another "
                         "--out")


class Answers:
    """One JSONL per method in Spec-Bench's answer format, plus each run's counters (`stats`) and
    what its table needs (`bench`). Each answer is appended and flushed as its prompt finishes, so a
    run cut short keeps every finished answer. Every line carries the run's fingerprint (its flags
    but --resume and --out): with resume, the answers of an earlier run of the same command are read
    back, the prompts answered by every method are kept and skipped, and the other lines dropped.
    Answer files already in the folder are never emptied unasked: without --resume or --overwrite
    check_out refuses the run before it starts."""

    def __init__(self, model, model_id, names, prompts, args):
        self.model, self.model_id, self.names, self.prompts = model, model_id, names, prompts
        self.run_id = fingerprint(model_id, args)
        self.folder, self.acceptance = args.out, args.acceptance
        self.known = {n: [None] * len(prompts) for n in names}
        os.makedirs(self.folder, exist_ok=True)
        lines = {n: self.read(n) if args.resume else [] for n in names}
        index = {p["question_id"]: i for i, p in enumerate(prompts)}
        done = (set.intersection(*({a["question_id"] for a in lines[n]} for n in names))
                & index.keys())
        self.files = {}
        for n in names:
            kept = [a for a in lines[n] if a["question_id"] in done]
            for a in kept:
                self.known[n][index[a["question_id"]]] = self.result(
                    a, prompts[index[a["question_id"]]])
            # the kept lines go to a new file that then replaces the old one: a kill at any moment
            # leaves the old file or the new one whole, never an emptied one
            new = self.path(n) + ".new"
            with open(new, "w") as f:
                f.writelines(json.dumps(a, allow_nan=False) + "\n" for a in kept)
            os.replace(new, self.path(n))
            self.files[n] = open(self.path(n), "a")
        self.resumed = len(done)

    def path(self, name):
        return os.path.join(self.folder, f"{self.model_id}-{name}.jsonl")

    def read(self, name):
        """The answers in name's file, each checked to be of this run. A last line cut short (the
        process killed while writing it) is dropped, saying so on stderr: its prompt is measured
        again. Any other line that is not an answer is refused, naming the file and the line."""
        path = self.path(name)
        if not os.path.exists(path):
            return []
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        # a file written whole ends with a newline, so its last piece is empty; else the last
        # piece is a line whose writing was cut
        last = len(lines) if lines[-1] else len(lines) - 1
        answers = []
        for n, line in enumerate(lines[:last], 1):
            if not line.strip():
                continue
            answer = self.parse(line)
            if answer is None and n == last and lines[-1]:
                print(f"{path} line {n}: cut short (the run was killed while writing it); dropped, "
                      "its prompt is measured again", file=sys.stderr)
                continue
            if answer is None:
                raise ValueError(f"{path} line {n} is not an answer of bench.py: the file is "
                                 "damaged; remove the line, or give another --out for a new run")
            if answer["run_id"] != self.run_id:
                raise ValueError(f"{path} holds answers of another run (other flags or model): "
                                 "--resume continues the same command; give another --out for a "
                                 "new run")
            answers.append(answer)
        return answers

    @staticmethod
    def parse(line):
        """An answer line as a dict, or None when it is not one (cut, or damaged)."""
        try:
            answer = json.loads(line.decode())
        except ValueError:  # also the UnicodeDecodeError of a character cut in two
            return None
        fields = ("question_id", "run_id", "stats", "bench", "choices")
        return answer if isinstance(answer, dict) and all(k in answer for k in fields) else None

    @staticmethod
    def result(answer, prompt):
        """An answer read back as the result run_all made of it."""
        nan = lambda x: float("nan") if x is None else x  # strict JSON keeps NaN as null
        stats = {k: nan(v) if k == "acceptance" else v for k, v in answer["stats"].items()}
        return dict(answer["bench"], decode_tok_s=nan(answer["bench"]["decode_tok_s"]), stats=stats,
                    accept_lengths=answer["choices"][0]["accept_lengths"], prompt=prompt)

    def write(self, name, _, r):
        p, st, tok = r["prompt"], r["stats"], self.model.tokenizer
        text = (answer_text(tok, r["tokens"], st["stop_token"]) if tok is not None
                else " ".join(map(str, r["tokens"])))
        choice = dict(index=0, turns=[text], decoding_steps=[len(r["accept_lengths"])],
                      new_tokens=[st["tokens"]], wall_time=[r["time_s"]],
                      accept_lengths=r["accept_lengths"])
        bench = {k: r[k] for k in ("tokens", "time_s", "tok_s", "decode_tok_s", "identical",
                                   "ar_match", "batch_id", "batch_s") if k in r}
        f = self.files[name]
        f.write(json.dumps(dict(question_id=p["question_id"], category=p["category"],
                                answer_id=uuid.uuid4().hex, model_id=f"{self.model_id}-{name}",
                                choices=[choice], tstamp=time.time(),
                                emulated_acceptance=self.acceptance, run_id=self.run_id,
                                stats=finite(st), bench=finite(bench)), allow_nan=False) + "\n")
        f.flush()

    def close(self):
        for f in self.files.values():
            f.close()
