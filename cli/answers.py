"""bench.py's answer files: one JSONL per method in Spec-Bench's answer format, written as the
prompts finish, and read back to resume a run cut short."""
import hashlib
import json
import os
import time
import uuid

from cli.output import answer_text, finite

class Answers:
    """One JSONL per method in Spec-Bench's answer format, plus each run's counters (`stats`) and
    what its table needs (`bench`). Each answer is appended and flushed as its prompt finishes, so a
    run cut short keeps every finished answer. Every line carries the run's fingerprint (its flags
    but --resume and --out): with resume, the answers of an earlier run of the same command are read
    back, the prompts answered by every method are kept and skipped, and the other lines dropped."""

    def __init__(self, model, model_id, names, prompts, args):
        self.model, self.model_id, self.names, self.prompts = model, model_id, names, prompts
        flags = {k: v for k, v in sorted(vars(args).items()) if k not in ("resume", "out")}
        self.run_id = hashlib.blake2b(json.dumps([model_id, flags], default=str).encode(),
                                      digest_size=8).hexdigest()
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
            self.files[n] = open(self.path(n), "w")
            self.files[n].writelines(json.dumps(a, allow_nan=False) + "\n" for a in kept)
            self.files[n].flush()
        self.resumed = len(done)

    def path(self, name):
        return os.path.join(self.folder, f"{self.model_id}-{name}.jsonl")

    def read(self, name):
        """The answers in name's file, each checked to be of this run."""
        if not os.path.exists(self.path(name)):
            return []
        with open(self.path(name)) as f:
            answers = [json.loads(line) for line in f if line.strip()]
        if any(a.get("run_id") != self.run_id for a in answers):
            raise ValueError(f"{self.path(name)} holds answers of another run (other flags or "
                             "model): --resume continues the same command; give another --out for "
                             "a new run")
        return answers

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
