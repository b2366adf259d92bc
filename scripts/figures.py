"""One source for the measured tables of README.md and docs/: each run below is a bench.py command;
`--measure` runs it and writes its figures, the machine (the CPU as lscpu names it), the date, the
torch version and the exact command to docs/figures/RUN.json; the pages' tables are rendered from
those files between the markers

    <!-- figures:TABLE -->
    ...
    <!-- /figures -->

    python scripts/figures.py --measure             # every run, one after the other, then render
    python scripts/figures.py --measure --only demo # one run (repeatable), then render
    python scripts/figures.py                       # render the pages from the JSON files alone
    python scripts/figures.py --check               # a page differing from its JSON: status 1

tests/test_figures.py holds the pages to the JSON files (the --check)."""
import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "docs", "figures")
PAGES = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT,
                                                                                       "docs")))
                         if n.endswith(".md")]
BASE = "python bench.py --clock cpu --threads 1 --out ''"
# name: bench.py's flags after BASE; the time each took here is in its JSON ("seconds")
RUNS = {
    "demo": "--methods ref-ar,ref-wfd,ar,dtv,wfd,wfd-shared",
    "demo-second": "--draft-steps 1 --second-depth 2 --methods wfd",
    "demo-compiled": "--methods ar,wfd --compile",
    "ouro-2.6b": "--random-weights configs/ouro-2.6b.json --dtype bfloat16 --acceptance 0.92 "
                 "--second-acceptance 0.97 --draft-steps 1 --second-depth 2 --num-prompts 1 "
                 "--prompt-len 8 --max-new-tokens 32 --methods ar,wfd",
    "huginn-0125": "--random-weights configs/huginn-0125.json --dtype bfloat16 --acceptance 0.94 "
                   "--second-acceptance 0.98 --draft-steps 4 --second-depth 8 --num-prompts 1 "
                   "--prompt-len 8 --max-new-tokens 16 --warmup 2 --methods ar,wfd",
}
DEMO = "demo (T=4), 15 held-out prompts x 128 tokens"
OURO = ("Ouro-2.6B config, random weights, bfloat16, emulated acceptance 0.92 (0.97 at m=2), "
        "32 tokens")
HUGINN = ("huginn-0125 config (3.5B), random weights, bfloat16, emulated acceptance 0.94 (0.98 at "
          "m=8), 16 tokens")
# table: (columns, rows: (run, what the run is, [(method, its label)]))
TABLES = {
    "readme": (["tok/s", "speedup", "R calls/token", "acceptance", "rescues"], [
        ("demo", DEMO + ", k=2, eager",
         [("ref-ar", "the reference's AR (wfd.py: a plain forward, one SDPA call per layer, "
                     "no lanes: the speed baseline)"),
          ("ref-wfd", "the reference's WFD (k=2)"),
          ("ar", "AR"), ("dtv", "DtV (draft length 4)"), ("wfd", "WFD (k=2)"),
          ("wfd-shared", "WFD, shared KV (this project's exact rule, not the paper's)")]),
        ("demo-second", "the same, `--draft-steps 1 --second-depth 2`",
         [("ar", "AR"), ("wfd", "WFD (k=1)"), ("wfd-2", "WFD-2 (k=1, m=2)")]),
        ("demo-compiled", "the demo, k=2, `--compile`", [("ar", "AR"), ("wfd", "WFD (k=2)")]),
        ("ouro-2.6b", OURO, [("ar", "AR"), ("wfd", "WFD (k=1)"), ("wfd-2", "WFD-2 (k=1, m=2)")]),
        ("huginn-0125", HUGINN,
         [("ar", "AR"), ("wfd", "WFD (k=4)"), ("wfd-2", "WFD-2 (k=4, m=8)")]),
    ]),
    "siblings": (["width", "tok/s", "speedup", "R calls/token", "acceptance", "rescues"], [
        ("demo-second", DEMO + ", eager",
         [("ar", "AR"), ("wfd", "WFD, k = 1"), ("ar-2", "AR, second-proposal width"),
          ("wfd-2", "WFD, k = 1, m = 2")]),
        ("ouro-2.6b", OURO, [("ar", "AR"), ("wfd", "WFD, k = 1"),
                             ("ar-2", "AR, second-proposal width"),
                             ("wfd-2", "WFD, k = 1, m = 2")]),
        ("huginn-0125", HUGINN, [("ar", "AR"), ("wfd", "WFD, k = 4"),
                                 ("ar-2", "AR, second-proposal width"),
                                 ("wfd-2", "WFD, k = 4, m = 8")]),
    ]),
    "real-size": (["width", "tok/s", "speedup", "R calls/token", "time per R call", "acceptance",
                   "identical"], [
        ("ouro-2.6b", "Ouro-2.6B config, 32 tokens",
         [("ar", "AR"), ("ar-wave", "AR at the wavefront's width"), ("wfd", "WFD (k = 1)"),
          ("ar-2", "AR at the second proposal's width"), ("wfd-2", "WFD-2 (k = 1, m = 2)")]),
        ("huginn-0125", "huginn-0125 config, 16 tokens",
         [("ar", "AR"), ("ar-wave", "AR at the wavefront's width"), ("wfd", "WFD (k = 4)"),
          ("ar-2", "AR at the second proposal's width"), ("wfd-2", "WFD-2 (k = 4, m = 8)")]),
    ]),
    "compiled": (["width", "tok/s", "speedup", "R calls/token", "acceptance", "graphs compiled"], [
        ("demo", DEMO + ", k=2, eager",
         [("ar", "AR"), ("ar-wave", "AR at the wavefront's width"), ("wfd", "WFD")]),
        ("demo-compiled", "the same, compiled",
         [("ar", "AR"), ("ar-wave", "AR at the wavefront's width"), ("wfd", "WFD")]),
    ]),
}


def nan(x):
    return x is None or x != x


def fmt(x, spec):
    return "–" if nan(x) else format(x, spec)


def tok_s(x):
    return fmt(x, ".1f" if x >= 10 else ".2f")


# column: its cell from a method's figures and plain AR's of the same run
COLUMNS = {
    "width": lambda f, ar: str(f["width"]),
    "tok/s": lambda f, ar: tok_s(f["tok_s"]),
    "speedup": lambda f, ar: fmt(f["tok_s"] / ar["tok_s"], ".2f") + "x",
    "R calls/token": lambda f, ar: fmt(f["r_per_token"], ".2f"),
    "time per R call": lambda f, ar: fmt(1000 * f["s_per_r_call"], ".0f") + " ms",
    "acceptance": lambda f, ar: fmt(f["acceptance"], ".2f"),
    "rescues": lambda f, ar: fmt(f["rescues"], ".2f"),
    "identical": lambda f, ar: f"{100 * f['identical']:.0f}%",
    "graphs compiled": lambda f, ar: str(f["graphs"]),
}


def command(name):
    return f"{BASE} {RUNS[name]}".strip()


def machine():
    """The CPU as lscpu names it: model name, family, model, the flags that decide bfloat16's speed
    (AVX-512's bfloat16 dot products, AMX), the CPUs."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    get = lambda key: fields.get(key, "?").strip()
    flags = get("Flags").split()
    return {"model name": get("Model name"), "CPU family": get("CPU family"), "model": get("Model"),
            "CPUs": get("CPU(s)"),
            "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]}


def measure_one(name):
    """Runs one command in this process (the --measure parent starts one process per run) and writes
    its JSON."""
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import torch
    import bench
    argv = shlex.split(command(name))[2:]
    t0 = time.time()
    out = bench.main(argv)
    seconds = time.time() - t0
    figs = {}
    for n, f in out["figs"].items():
        recs = out["results"][n]
        figs[n] = {k: (None if nan(v) else v) for k, v in f.items()
                   if k in ("tok_s", "r_per_token", "acceptance", "rescues", "identical", "width",
                            "graphs")}
        figs[n]["s_per_r_call"] = (sum(r["time_s"] for r in recs)
                                   / sum(r["stats"]["r_calls"] for r in recs))
    record = {"run": name, "command": command(name), "machine": machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "torch": torch.__version__, "seconds": round(seconds), "methods": figs}
    os.makedirs(FOLDER, exist_ok=True)
    with open(os.path.join(FOLDER, name + ".json"), "w") as f:
        json.dump(record, f, indent=1, allow_nan=False)
        f.write("\n")


def read(name):
    """A run's JSON, or None before it is measured."""
    path = os.path.join(FOLDER, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def cpu(m):
    return (f"{m['model name']} (lscpu: CPU family {m['CPU family']}, model {m['model']}; "
            f"{m['CPUs']} CPUs; {', '.join(m['flags'])})")


def render(table):
    """The table's markdown, and below it where each run comes from: the machine, the date, torch,
    the command."""
    columns, rows = TABLES[table]
    lines = ["| model, run | method | " + " | ".join(columns) + " |",
             "|" + "---|" * (len(columns) + 2)]
    sources = []
    for run, what, methods in rows:
        r = read(run)
        if r is None:
            lines.append(f"| {what} | not measured yet: `python scripts/figures.py --measure "
                         f"--only {run}` |" + " |" * len(columns))
            continue
        if r["command"] != command(run):
            raise ValueError(f"docs/figures/{run}.json was measured by another command than "
                             f"RUNS[{run!r}]: run scripts/figures.py --measure --only {run}")
        ar = r["methods"]["ar"]
        for i, (method, label) in enumerate(methods):
            f = r["methods"][method]
            lines.append(f"| {what if i == 0 else ''} | {label} | "
                         + " | ".join(COLUMNS[c](f, ar) for c in columns) + " |")
        if run not in [s["run"] for s in sources]:
            sources.append(r)
    places = {(cpu(s["machine"]), s["torch"]) for s in sources}
    one = len(places) == 1
    where = (f"on {cpu(sources[0]['machine'])}, torch {sources[0]['torch']}" if one
             else "as each command says")
    lines += ["", textwrap.fill(f"Measured {where}, one thread, CPU-time clock; each speedup "
                                "against the AR of the same run (`python scripts/figures.py "
                                "--measure --only RUN` measures it again):", 100), "", "```"]
    lines += [f"{s['command']}   # {s['run']}, {s['date']}"
              + ("" if one else f", {cpu(s['machine'])}, torch {s['torch']}") for s in sources]
    return "\n".join(lines + ["```"])


MARKED = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def rendered(text):
    """The page's text with every marked table rendered from the JSON files."""
    return MARKED.sub(lambda m: m[1] + render(m[2]) + "\n" + m[4], text)


def pages():
    """page -> its text as it is, for every page holding a marked table."""
    out = {}
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        if MARKED.search(text):
            out[page] = text
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", action="store_true", help="run the commands, then render")
    p.add_argument("--only", action="append", choices=list(RUNS), help="this run alone")
    p.add_argument("--check", action="store_true", help="render nothing: status 1 when a page "
                   "differs from its JSON files")
    p.add_argument("--one", choices=list(RUNS), help=argparse.SUPPRESS)  # the child of --measure
    args = p.parse_args(argv)
    if args.one:
        return measure_one(args.one)
    if args.measure:
        for name in args.only or RUNS:
            print(f"== {name}: {command(name)}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], check=True)
    stale = []
    for page, text in pages().items():
        new = rendered(text)
        if new != text:
            stale.append(page)
            if not args.check:
                with open(os.path.join(ROOT, page), "w") as f:
                    f.write(new)
    if args.check and stale:
        print("differ from docs/figures/: " + ", ".join(stale), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
