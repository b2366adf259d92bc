"""A bench.py sweep's table and figure (`bench.py --sweep NAME [--plot FILE.png]`, or `--plot-from`
a saved sweep-NAME.json). The figure: each method's measured speedup over AR as markers, the ideal
T / (A*k + (1-A)*T) as a line, AR at 1, and WFD's R-call ratio as open squares. matplotlib is an
optional dependency, imported only to draw."""
import json
import math

PIXELS = (640, 400)  # the PNG's size: small enough to commit, wide enough for the legend
DPI = 100
MARKERS = "osD^v<>"
# a sweep's point: its column in the table, and the figure's x axis
AXES = {
    "acceptance": ("A (emulated)", "draft acceptance, measured (accepted / verified drafts)"),
    "draft-steps": ("k", "draft depth k (recurrences of a draft)"),
    "length": ("prompt tokens", "prompt length (tokens)"),
    "batch": ("batch", "batch size (sequences decoded together)"),
    "second-depth": ("m", "second depth m (recurrences before a row's second read)"),
}
LEGEND = """\
- the point: the emulated acceptance A, the draft depth k, the prompt length, the batch size or
  the second proposal's depth m (its figure: R calls per token, measured and by its cost model).
  acceptance: WFD's, measured (accepted / verified drafts); ideal: T / (A*k + (1-A)*T) at that
  acceptance, the wavefront's speedup if a call cost the same at every width and nothing else took
  time; WFD / ideal: the share of it WFD reaches.
- tok/s, speedup: mean over prompts of new tokens / time, prefill included, and that mean over plain
  AR's, as in bench.py's table. R-call ratio: AR's sequential R calls per token over the method's.
- AR's runs have no drafts: plain AR and each method's exact reference (AR at the method's width)
  are measured once and reused at every later point with the same settings (every point of the
  acceptance sweep; in the draft-steps sweep, the points of the same width; in the length and
  batch sweeps, none); * marks AR's tok/s measured at an earlier point. The references' figures
  are in the JSON.
- identical: every method's tokens and logits equal its exact reference's on every prompt."""
BATCH_LEGEND = """\
- batch B: each method decodes all the prompts in one batched call through B slots (B sequences in
  every call; a finished sequence's slot takes the next prompt). tok/s is then not a mean over
  prompts but every new token over that call's time; speedup: over AR's at the same batch. decode
  speedup: the mean over prompts of each sequence's own tokens per second from its first token to
  its last, over AR's. identical: against AR at the method's width and the same batch (the same
  slots). KV MiB: the whole batch's cache, B sequences'."""
KEYS = {"sweep", "x_label", "model", "machine", "device", "threads", "torch", "dtype", "clock",
        "command", "date", "T", "draft_len", "emulated_acceptance", "prompts", "prompt_source",
        "max_new_tokens", "decoding", "shown", "points"}


def sweep_flag(name):
    """The flag that runs the sweep `name`: the batch sweep's points are its own flag's."""
    return "--batch-sizes" if name == "batch" else f"--sweep {name}"


def batch_text(batch_size):
    return ("batch 1" if batch_size is None
            else f"batch {batch_size} (slots refilled as sequences finish)")


def on_gpu(device):
    """Whether `device`, a torch.device or its name ("cpu", "cuda", "cuda:1"), is a CUDA device."""
    return str(device).partition(":")[0] == "cuda"


def machine_text(device, machine, threads):
    """Where a run ran, as its header says: on a CUDA device (any index) the GPU's name, `machine`
    (bench.machine names the model's own GPU), on a CPU the CPU's and its threads."""
    return machine if on_gpu(device) else f"{machine}, {threads} CPU thread(s)"


def compiled_text(device):
    """What compiled a run's calls on `device`: CUDA graphs replayed on any CUDA device."""
    return "torch.compile" + (", CUDA graphs" if on_gpu(device) else "")


def ideal_speedup(T, k, acceptance):
    """The wavefront's ideal speedup T / (A*k + (1-A)*T); 1 at k = T, where it has no drafts
    to accept."""
    return 1.0 if k == T else T / (acceptance * k + (1 - acceptance) * T)


def second_proposal_calls(T, k, m, accepted, rescued):
    """R calls per token of the second proposal in steady state: a token commits k ticks after the
    one before when the draft was right, m when its sibling was (it started m - k ticks later),
    T after a restart: a*k + r*m + (1-a-r)*T."""
    return accepted * k + rescued * m + (1 - accepted - rescued) * T


def table(sweep):
    """The sweep as markdown: one row per point."""
    shown = sweep["shown"]
    fmt = lambda x, f: "–" if x is None else format(x, f)
    label = {n: f["label"] for n, f in sweep["points"][0]["methods"].items()}
    head = [AXES[sweep["sweep"]][0], "acceptance", "ideal", "WFD / ideal", f"{label['ar']} tok/s"]
    for n in shown[1:]:
        head += [f"{label[n]} {c}" for c in ("tok/s", "speedup", "R-call ratio")]
    lines = ["| " + " | ".join(head + ["identical"]) + " |", "|" + "---|" * (len(head) + 1)]
    for j, p in enumerate(sweep["points"]):
        m, wave = p["methods"], p["methods"]["wfd"]
        cells = [str(p["x"]), fmt(p["acceptance"], ".3f"), fmt(p["ideal"], ".2f") + "x",
                 fmt(None if p["ideal"] is None else wave["speedup"] / p["ideal"], ".2f"),
                 fmt(m["ar"]["tok_s"], ".2f") + ("*" if m["ar"]["measured_at_point"] != j else "")]
        for n in shown[1:]:
            cells += [fmt(m[n]["tok_s"], ".2f"), fmt(m[n]["speedup"], ".2f") + "x",
                      fmt(m[n]["r_call_ratio"], ".2f") + "x"]
        differ = [f["label"] for f in m.values() if f["identical"] != 1]
        lines.append("| " + " | ".join(cells + ["NO: " + ", ".join(differ) if differ else "yes"])
                     + " |")
    return "\n".join(lines)


def text(sweep):
    """The sweep as bench.py prints it: a header, the table, the legend (markdown)."""
    s = sweep
    emulated = ("" if s["emulated_acceptance"] is None
                else f", emulated acceptance A={s['emulated_acceptance']}")
    depth = "" if s["sweep"] == "draft-steps" else f", k={s['points'][0]['k']}"
    prompts = "each point's length" if s["sweep"] == "length" else s["prompt_source"]
    # a file from before batched decoding has no batch_size: it ran one prompt at a time
    batch = "each point's batch" if s["sweep"] == "batch" else batch_text(s.get("batch_size"))
    machine = machine_text(s["device"], s["machine"], s["threads"])
    return (f"## bench.py {sweep_flag(s['sweep'])}: {s['model']}{emulated}\n\n"
            f"- {s['date']}; {machine}; torch {s['torch']}; {s['dtype']}; "
            f"{s['clock']} clock\n- `{s['command']}`\n"
            f"- T={s['T']}{depth}, DtV draft length {s['draft_len']}; {s['prompts']} prompts "
            f"({prompts}), up to {s['max_new_tokens']} new tokens, "
            f"{s['decoding']}, {batch}\n\n{table(s)}\n\n{LEGEND}"
            + ("" if batch == "batch 1" else "\n" + BATCH_LEGEND) + drift(s))


def drift(sweep):
    """The line on AR's run measured again after the last point, where earlier points' runs
    were reused."""
    again, first = sweep.get("ar_again_tok_s"), sweep["points"][0]["methods"]["ar"]["tok_s"]
    if again is None:  # AR measured at every point, or a file from before the check
        return ""
    return (f"\n\nAR run again after the last point: {again:.2f} tok/s, {again / first:.2f}x its "
            f"{first:.2f} at the first point; the speedups of the points that reuse AR's first "
            "runs carry that drift")


def need_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, an optional dependency: pip "
                         "install matplotlib") from None


def read_sweep(path):
    """A sweep-NAME.json written by bench.py, checked for what plot reads."""
    with open(path) as f:
        try:
            sweep = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path} is not JSON ({err})") from None
    missing = KEYS - set(sweep) if isinstance(sweep, dict) else KEYS
    if missing:
        raise ValueError(f"{path} is not a bench.py sweep file: it has no "
                         f"{', '.join(sorted(missing))}")
    if sweep["sweep"] not in AXES or not sweep["points"]:
        raise ValueError(f"{path} holds no points of a sweep of {', '.join(AXES)}")
    return sweep


def plot(sweep, path):
    need_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(PIXELS[0] / DPI, PIXELS[1] / DPI), dpi=DPI)
    FigureCanvasAgg(fig)  # no pyplot, no global backend: Agg draws this figure alone
    ax = fig.add_subplot()
    if sweep["sweep"] == "second-depth":
        plot_calls(ax, sweep)
    else:
        plot_speedups(ax, sweep)
    ax.set_xlabel(sweep["x_label"])
    ax.set_title(f"{sweep['model']}, bench.py {sweep_flag(sweep['sweep'])}\n"
                 f"{sweep['machine']}, {sweep['dtype']}, {sweep['clock']} clock", fontsize=9)
    ax.grid(alpha=0.3)
    low, high = ax.get_ylim()  # room above the points for the legend
    ax.set_ylim(low, high + 0.3 * (high - low))
    ax.legend(loc="upper left", ncol=2, fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)  # without bbox_inches="tight", which would change the size


def plot_calls(ax, sweep):
    """The second depth's figure: R calls per token of the second proposal at each m, measured and
    by its cost model at the measured rates, beside plain WFD's at the same k and AR's T."""
    points, T = sweep["points"], sweep["T"]
    xs, k = [p["x"] for p in points], points[0]["k"]
    value = lambda x: math.nan if x is None else x
    ax.axhline(T, ls="--", color="0.5", label=f"AR ({T})")
    ax.plot(xs, [value(p["methods"]["wfd"]["r_calls_per_token"]) for p in points], "s",
            color="C1", label=f"WFD, k={k}, measured")
    ax.plot(xs, [value(p["methods"]["wfd-2"]["r_calls_per_token"]) for p in points], "o",
            color="C0", label=f"WFD, k={k}, second proposal at m, measured")
    ax.plot(xs, [value(p["methods"]["wfd-2"]["r_calls_formula"]) for p in points], "-",
            color="0.25", label="a·k + r·m + (1−a−r)·T at the measured a, r")
    ax.set_xticks(xs)
    ax.set_ylabel("R calls per token (sequential)")


def plot_speedups(ax, sweep):
    """Each method's speedup over AR at each point, under the ideal curve."""
    points, T = sweep["points"], sweep["T"]
    # undefined (no draft verified): left out of the plot
    value = lambda x: math.nan if x is None else x
    if sweep["sweep"] == "acceptance":
        # the sweep emulates A; each method's marker sits at the acceptance it measured, under the
        # curve that acceptance promises (k is the same at every point)
        k = points[0]["k"]
        low = min([m["acceptance"] for p in points for m in p["methods"].values()
                   if m["acceptance"] is not None]
                  + [0.5])
        grid = [low + (1 - low) * i / 100 for i in range(101)]
        ax.plot(grid, [ideal_speedup(T, k, a) for a in grid], "-", color="0.25",
                label=f"ideal T / (A·k + (1−A)·T), T={T}, k={k}")
        where = lambda name: [value(p["methods"][name]["acceptance"]) for p in points]
    else:
        xs = [p["x"] for p in points]
        ax.plot(xs, [value(p["ideal"]) for p in points], "-", color="0.25",
                label=f"ideal T / (A·k + (1−A)·T) at WFD's measured A, T={T}"
                + ("" if sweep["sweep"] == "draft-steps" else f", k={points[0]['k']}"))
        where = lambda name: xs
    ax.axhline(1.0, ls="--", color="0.5", label="AR (1.0)")
    colors = {}
    for i, (marker, name) in enumerate(zip(MARKERS, sweep["shown"][1:])):
        colors[name] = f"C{i}"
        ax.plot(where(name), [value(p["methods"][name]["speedup"]) for p in points], marker,
                ls="none", color=colors[name],
                label=f"{points[0]['methods'][name]['label']}, measured")
    # the schedule's own gain, whatever a call costs: where the time falls short of it, the calls'
    # cost (their width, C, P, the prefill) is why
    ax.plot(where("wfd"), [value(p["methods"]["wfd"]["r_call_ratio"]) for p in points], "s",
            mfc="none", color=colors["wfd"], label="WFD, R-call ratio (AR's R calls / WFD's)")
    if sweep["sweep"] == "draft-steps":
        ax.set_xticks([p["x"] for p in points])
    ax.set_ylabel("speedup over AR (×, ratio of tok/s)")
