"""Smoke tests of bench.py: a few seconds on the golden checkpoints and on tiny random-weight
models. They check the table and the answer files, never timings."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import bench
import cli.answers
import models
import engine
from test_chat import CHATML, checkpoint, tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the project
HEADER = "| " + " | ".join(bench.COLUMNS) + " |"


def rows(text):
    """The overall table's rows: label -> cells."""
    overall = text[text.index("### overall"):]
    lines = [line for line in overall.splitlines()
             if line.startswith("| ") and not line.startswith(HEADER[:-2])]
    return {cells[0]: cells
            for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def run_bench(capsys, args):
    threads = torch.get_num_threads()
    try:  # one thread: tiny models only lose from more, and most when the CPU is busy
        out = bench.main(args + ["--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return out, capsys.readouterr().out


def check_answers(folder, model_id, out):
    for name in out["names"]:
        with open(os.path.join(folder, f"{model_id}-{name}.jsonl")) as f:
            answers = [json.loads(line) for line in f]
        assert len(answers) == len(out["results"][name])
        for a in answers:
            assert ({"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
                    <= a.keys())
            c = a["choices"][0]
            # each round commits one full-depth token plus the accepted drafts after it
            assert sum(c["accept_lengths"]) == c["new_tokens"][0] == a["stats"]["tokens"]
            assert (len(c["accept_lengths"]) == c["decoding_steps"][0]
                    == a["stats"]["tokens"] - a["stats"]["accepted"])


def test_golden_checkpoint(capsys, tmp_path):
    out, text = run_bench(capsys, ["--model", os.path.join(HERE, "testdata", "ouro_A"),
                                   "--num-prompts", "2", "--prompt-len", "5",
                                   "--max-new-tokens", "12", "--warmup", "2",
                                   "--out", str(tmp_path)])
    assert HEADER in text
    table = rows(text)
    assert [r[0] for r in table.values()] == [bench.METHODS[n][3] for n in out["names"]]
    assert {"ar", "dtv", "wfd"} <= set(out["names"])
    for cells in table.values():
        assert len(cells) == len(bench.COLUMNS) and cells[-2] == "100%"  # every mode is exact
    assert table["AR"][3] == "1.00x" and table["AR"][8] == "4.00" and table["AR"][1] == "1"
    check_answers(tmp_path, "ouro_A", out)


def small_run(folder, *extra):
    return ["--model", os.path.join(HERE, "testdata", "ouro_A"), "--num-prompts", "2",
            "--prompt-len", "4", "--max-new-tokens", "6", "--warmup", "0", "--methods", "wfd",
            "--out", str(folder), *extra]


def answer_files(folder):
    return {p: open(os.path.join(folder, p)).read() for p in sorted(os.listdir(folder))}


def test_a_rerun_keeps_the_answers_unless_told(capsys, tmp_path):
    """bench.py --out D again, where D holds the answers of an earlier run: refused in one line
    (status 2) naming --resume and --overwrite, every answer intact; --overwrite starts again."""
    run_bench(capsys, small_run(tmp_path))
    before = answer_files(tmp_path)
    assert len(before) == 3 and all(before.values())
    with pytest.raises(SystemExit) as exit:
        run_bench(capsys, small_run(tmp_path))
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"error: --out {tmp_path} holds the answers of an earlier run")
    assert "--resume" in err[-1] and "--overwrite" in err[-1]
    assert answer_files(tmp_path) == before
    with pytest.raises(SystemExit):
        run_bench(capsys, small_run(tmp_path, "--resume", "--overwrite"))
    assert "not --resume" in capsys.readouterr().err
    run_bench(capsys, small_run(tmp_path, "--overwrite"))
    after = answer_files(tmp_path)
    assert after.keys() == before.keys() and after != before  # new answer ids and times
    assert all(len(after[p].splitlines()) == 2 for p in after)


def test_a_kill_while_resuming_loses_no_answer(capsys, tmp_path, monkeypatch):
    """--resume writes the answers it keeps back: to a new file that then replaces the old one, so
    that a kill while they are written (here: on the first write) leaves the old file whole."""
    run_bench(capsys, small_run(tmp_path))
    before = answer_files(tmp_path)
    real_open = open

    def killed(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode:
            def kill(*_):
                raise KeyboardInterrupt
            f.write = f.writelines = kill
        return f
    monkeypatch.setattr(cli.answers, "open", killed, raising=False)  # the module's open alone
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        run_bench(capsys, small_run(tmp_path, "--resume"))
    monkeypatch.undo()
    assert {p: answer_files(tmp_path)[p] for p in before} == before


@pytest.mark.skipif(not os.path.isdir(bench.DEMO), reason="no demo model (python demo/train.py)")
def test_demo_stdlib_prompts(capsys, tmp_path):
    """The demo model on its built-in held-out prompt set: real text through its tokenizer."""
    out, text = run_bench(capsys, ["--limit", "3", "--max-new-tokens", "8", "--warmup", "2",
                                   "--out", str(tmp_path)])
    assert "### overall (3 prompts)" in text and "held-out stdlib" in text
    for cells in rows(text).values():
        assert cells[-2] == "100%"
    check_answers(tmp_path, "demo", out)


@pytest.mark.skipif(not os.path.isdir(bench.DEMO), reason="no demo model (python demo/train.py)")
def test_specbench_questions(capsys):
    """Spec-Bench's questions, first turns, a table per category."""
    questions = os.path.join(ROOT, "data", "specbench", "question.jsonl")
    out, text = run_bench(capsys, ["--questions", questions, "--categories", "qa,math_reasoning",
                                   "--per-category", "1", "--max-new-tokens", "8", "--warmup", "0",
                                   "--methods", "wfd", "--out", ""])
    assert "### qa (1 prompts)" in text and "### math_reasoning (1 prompts)" in text
    assert [p["prompt"]["question_id"] for p in out["results"]["ar"]] == [321, 401]
    assert all(cells[-2] == "100%" for cells in rows(text).values())


def test_random_weights_emulated(capsys, tmp_path):
    config = os.path.join(HERE, "testdata", "huginn_A", "config.json")
    out, text = run_bench(capsys, ["--random-weights", config, "--acceptance", "0.8",
                                   "--steps", "8", "--draft-steps", "2", "--num-prompts", "2",
                                   "--prompt-len", "6", "--max-new-tokens", "16", "--warmup", "0",
                                   "--out", str(tmp_path)])
    assert "emulated acceptance A=0.8" in text
    wave, ar = out["figs"]["wfd"], out["figs"]["ar"]
    a = wave["acceptance"]
    ideal = 8 / (a * 2 + (1 - a) * 8)  # T = 8, k = 2
    assert (f"{ideal:.2f}x at the measured {a:.3f}; "
            f"WFD reaches {wave['tok_s'] / ar['tok_s'] / ideal:.2f} of it"
            in text)
    # the R calls' host time is part of each run's time, and is printed per method on a CPU
    assert all(0 < r["stats"]["r_seconds"] < r["stats"]["wall_s"]
               for name, recs in out["results"].items() if name not in bench.REFERENCE
               for r in recs)
    assert "R calls after the prefill" in text
    for cells in rows(text).values():
        assert cells[-2] == "100%"
    check_answers(tmp_path, "config-random", out)


def test_emulated_acceptance_extremes(capsys):
    """A=1 accepts every verified draft and A=0 none, and the output still equals AR's."""
    config = os.path.join(HERE, "testdata", "ouro_A", "config.json")
    for a in ("1.0", "0.0"):
        out, _ = run_bench(capsys, ["--random-weights", config, "--acceptance", a,
                                    "--methods", "dtv,wfd", "--num-prompts", "1",
                                    "--prompt-len", "4", "--max-new-tokens", "12", "--warmup", "0",
                                    "--out", ""])
        figs = out["figs"]
        for name in ("dtv", "wfd"):
            assert figs[name]["acceptance"] == float(a) and figs[name]["identical"] == 1
        if a == "1.0":  # every draft right: fewer sequential R calls than AR
            assert figs["wfd"]["r_per_token"] < figs["ar"]["r_per_token"]
    # one new token is the prefill's: no draft, no R call after it, and the summary still prints
    out, text = run_bench(capsys, ["--random-weights", config, "--methods", "wfd",
                                   "--num-prompts", "1", "--prompt-len", "4",
                                   "--max-new-tokens", "1", "--warmup", "0", "--out", ""])
    assert "WFD none, 0% of the time" in text and "Ideal WFD speedup" not in text


@pytest.mark.slow
def test_compiled(capsys):
    """--compile: one KV capacity for every prompt, the warm-up compiles (and is timed apart), the
    timed runs compile nothing, the output is still exact. k = T puts every method at width 1: one
    set of graphs to compile."""
    config = os.path.join(HERE, "testdata", "ouro_A", "config.json")
    out, text = run_bench(capsys, ["--random-weights", config, "--compile", "--methods", "wfd",
                                   "--draft-steps", "4", "--num-prompts", "2", "--prompt-len", "4",
                                   "--max-new-tokens", "12", "--warmup", "2", "--out", ""])
    assert ("compiled (torch.compile), KV capacity 15" in text
            and "Warm-up, wall clock (compiling" in text)
    assert all(r["stats"]["compiled"] for n in out["names"] for r in out["results"][n])
    identical = bench.COLUMNS.index("identical")
    assert all(cells[identical] == "100%" and cells[-1] == "0" for cells in rows(text).values())
    assert ("Graphs compiled during the timed runs: 0 (the warm-up compiled every graph they met)"
            in text)


def test_a_run_is_labelled_with_the_models_own_device(capsys, monkeypatch):
    """bench.py's header names the model's own GPU on any CUDA device (its index given to
    torch.cuda.get_device_name, a stand-in here: cuda:1, while cuda:0 is current), with no CPU
    threads and, compiled, with CUDA graphs; the CPU's name and threads on cpu alone. The run is
    a CPU's, its summary printed again as if the model were on cuda:1 (--device cuda:1
    --compile). (test_sweep_batch: the figures' label of a sweep run on cuda:1.)"""
    gpus = ["GPU zero", "GPU one"]
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: gpus[0 if device is None else device.index])

    class OnCuda1:  # the model, on cuda:1
        device = torch.device("cuda", 1)

        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)
    summary = bench.print_summary

    def both(model, *a):
        summary(model, *a)
        args = a[-3]
        args.device, args.compile = "cuda:1", True
        summary(OnCuda1(model), *a)
    monkeypatch.setattr(bench, "print_summary", both)
    config = os.path.join(HERE, "testdata", "ouro_A", "config.json")
    _, text = run_bench(capsys, ["--random-weights", config, "--methods", "wfd", "--num-prompts",
                                 "1", "--prompt-len", "4", "--max-new-tokens", "4",
                                 "--batch-size", "1", "--warmup", "0", "--out", ""])
    on_cpu, on_gpu = text.split("## bench.py: ")[1:]
    assert f"UTC; {bench.cpu_name()}, 1 CPU thread(s); torch" in on_cpu
    assert "UTC; GPU one; torch" in on_gpu and "CPU thread" not in on_gpu
    assert "; compiled (torch.compile, CUDA graphs), KV capacity" in on_gpu


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    """gpu_check.sh, the GPU checks, in its CPU smoke mode, under this interpreter: its steps'
    estimates fit the device run's budget; the configs benchmarked, exact, and AR set against the
    bandwidth bound, compiled (nothing compiled, re-recorded or skipped in the timed runs) and
    eager; the batch sweep, a row per batch size; every step's results in RESULTS, the machine's
    (versions, pytest-xdist or not) first."""
    env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path))
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--smoke"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"the steps' estimates sum to \d+ s of 540 s", done.stderr)
    triton, xdist = (importlib.util.find_spec(name) for name in ("triton", "xdist"))
    triton = triton and importlib.import_module("triton")
    assert (tmp_path / "env.txt").read_text() == (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}\n"
        f"Triton {triton.__version__ if triton else 'not installed'}\n"
        f"pytest-xdist {'installed' if xdist else 'not installed'}\nno CUDA device\n")
    assert done.stdout.count("Bandwidth bound: ") == 5 and done.stdout.count("| WFD | ") == 5
    nothing = ("during the timed runs of 3 answers: {'graphs_compiled': 0, "
               "'cuda_graphs_rerecorded': 0, 'cuda_graphs_skipped': 0}")
    assert done.stdout.count(nothing) == 3
    lines = done.stdout.splitlines()
    assert sum(line.startswith("## bench.py --batch-sizes: ") for line in lines) == 1
    assert [sum(line.startswith(f"| {b} | ") and line.endswith("| yes |") for line in lines)
            for b in (1, 2)] == [1, 1]
    assert "OUTPUT DIFFERS" not in done.stderr
    steps = (tmp_path / "steps.txt").read_text()
    assert [line.split(":")[0] for line in steps.splitlines()] == [
        "env", "huginn-c", "huginn-c-check", "ouro-c", "ouro-c-check", "huginn", "ouro", "batch",
        "parcae", "parcae-check"]


def test_gpu_check_keeps_the_verdicts_of_a_step_cut_short(tmp_path):
    """A test step killed by its timeout (TIMEOUT_S here) leaves in OUT, the folder a device run
    hands back, and on stdout each ended case's verdict, and names the case it was running."""
    cases, out = tmp_path / "cases", tmp_path / "out"
    cases.mkdir()
    (cases / "test_cut.py").write_text("import time\n\n\ndef test_ends():\n    pass\n\n\n"
                                       "def test_hangs():\n    time.sleep(300)\n")
    (cases / "conftest.py").write_text(  # the test step's flag, in a folder of its own
        "def pytest_addoption(parser):\n    parser.addoption('--runslow', action='store_true')\n")
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), STEPS="tests",
               TESTS=str(cases / "test_cut.py"), TIMEOUT_S="10")
    env.pop("RESULTS", None)
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--smoke"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stderr
    text = (out / "tests.txt").read_text()
    # a case's id is relative to pytest's rootdir, which depends on where the clone lies (/tmp/x:
    # /tmp, and the id holds the path from there)
    killed = (r"\ngpu_check: tests killed by its timeout \(10 s\) while running: "
              r"(\S*/)?test_cut.py::test_hangs\n$")
    assert re.search(r"test_cut.py::test_ends PASSED", text) and re.search(killed, text)
    assert done.stdout == text
    assert (out / "steps.txt").read_text().startswith("tests: killed by its timeout after ")


def test_real_configs():
    """The shipped real-size configs build (on the meta device: no memory) at the
    published sizes."""
    for name, params in (("huginn-0125", 3_564_976_800), ("ouro-2.6b", 2_667_972_608),
                         ("parcae-140m", 144_323_136), ("parcae-1.3b", 1_338_591_744)):
        with open(os.path.join(ROOT, "configs", f"{name}.json")) as f:
            config = json.load(f)
        with torch.device("meta"):
            model = models.LoopedLM(models.ModelArgs.from_config(config), config)
        assert sum(p.numel() for p in model.parameters()) == params


# the Thinking models' kind of template: ChatML, and <think> after the generation prompt on request
THINKING = CHATML.replace("{{- '<|im_start|>assistant\\n' }}",
                          "{{- '<|im_start|>assistant\\n' }}"
                          "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}")


@pytest.mark.parametrize("name,kind", [("Ouro-2.6B-Thinking", "ouro"), ("Ouro-2.6B", "ouro"),
                                       ("huginn-0125", "huginn")])
def test_paper_protocol(name, kind, tmp_path, capsys):
    """--paper on the goldens given a tokenizer and a chat template (and the real ones' names): the
    family's T and k, the questions raw or (a Thinking model) in the chat template with <think>,
    right-truncated, and the paper's figure where it has one. Flags given win over the
    protocol's."""
    folder = checkpoint(tmp_path, kind, {"eos_token_id": [0] if kind == "ouro" else [121, 124]},
                        {"chat_template": THINKING}, name=name)
    faster = (["--steps", "8", "--draft-steps", "2"] if kind == "huginn"
              else [])  # than Huginn's T=32
    out, text = run_bench(capsys, ["--paper", "--model", folder, "--limit", "2",
                                   "--max-prompt-tokens", "40", "--max-new-tokens", "4",
                                   "--warmup", "0", "--out", ""] + faster)
    T, k = (4, 1) if kind == "ouro" else (32, 4)
    first = text.splitlines()[0]
    assert (first.startswith("paper protocol: --questions ")
            and f"--steps {T} --draft-steps {k} --dtype bfloat16" in first)
    T, k = (8, 2) if faster else (T, k)
    assert f"T={T}, k={k}," in text and "; bfloat16;" in text and "up to 4 new tokens" in text
    chat = "thinking" in name.lower()
    assert ("Spec-Bench, first turns, chat template, truncated to 40 tokens" if chat
            else "raw text, truncated") in text
    with open(bench.QUESTIONS) as f:
        turns = [json.loads(f.readline())["turns"][0].strip() for _ in range(2)]
    tok = tokenizer(kind)
    for r, turn in zip(out["results"]["ar"], turns):
        full = (tok.encode(f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n<think>\n",
                           add_special_tokens=False).ids if chat else tok.encode(turn).ids)
        assert len(full) > 40 and r["prompt"]["ids"] == full[:40]
        assert r["prompt"]["eos"] == ((0, 2) if chat else (0,) if kind == "ouro" else (121, 124))
    assert out["names"] == (["ar", "ar-wave", "wfd"]
                            + (["ar-shared", "wfd-shared"] if kind == "huginn" else []))
    assert all(cells[-2] == "100%" for cells in rows(text).values())
    if name == "Ouro-2.6B":
        assert ("beside ours: WFD 2.42x "
                f"(ours: {out['figs']['wfd']['tok_s'] / out['figs']['ar']['tok_s']:.2f}x)" in text)
    elif kind == "huginn":
        assert "WFD 3.54x (ours: " in text and ("; WFD with the paper's cross-recurrence KV "
                                                "sharing, lossy 4.81x (ours, another method: WFD "
                                                "with this project's exact shared KV: ") in text
    else:
        assert "The paper reports no Spec-Bench speedup for Ouro-2.6B-Thinking." in text


# -- sweeps and their figures ----------------------------------------------------------------------

OURO_A = os.path.join(HERE, "testdata", "ouro_A")
SWEEP_KEYS = {"sweep", "x_label", "model", "machine", "device", "threads", "torch", "dtype",
              "clock", "command", "date", "T", "draft_len", "emulated_acceptance", "prompts",
              "prompt_source", "max_new_tokens", "decoding", "compiled", "shown", "points",
              "ar_again_tok_s", "batch_size", "run_id"}
POINT_KEYS = {"x", "k", "prompt_len", "prompt_source", "acceptance", "ideal", "methods"}
METHOD_KEYS = {"label", "width", "tok_s", "speedup", "decode_speedup", "r_calls_per_token",
               "r_call_ratio", "acceptance", "rescues", "tokens_per_round", "kv_mib", "identical",
               "measured_at_point"}


def sweep(capsys, tmp_path, args):
    """A sweep on the ouro_A golden checkpoint (T = 4, k = 1): one prompt of 4 ids, 8 new tokens."""
    out, text = run_bench(capsys, ["--model", OURO_A, "--num-prompts", "1", "--max-new-tokens", "8",
                                   "--warmup", "0", "--out", str(tmp_path)] + args)
    with open(tmp_path / f"sweep-{out['sweep']}.json") as f:
        saved = json.load(f)
    assert saved == out  # strict JSON: what was measured, NaN written as null
    assert saved.keys() == SWEEP_KEYS
    assert saved["torch"] == torch.__version__ and saved["dtype"] == "float32" and saved["machine"]
    assert (saved["command"].startswith("python bench.py --model")
            and bench.figures.sweep_flag(out["sweep"]) in saved["command"])
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(saved["points"])  # the header and a row per point
    for j, p in enumerate(saved["points"]):
        assert p.keys() == POINT_KEYS
        a = p["acceptance"]
        if a is None:  # no draft verified: k = T, where the wavefront is AR
            assert p["k"] == 4 and p["ideal"] == 1
        else:
            assert p["ideal"] == pytest.approx(4 / (a * p["k"] + (1 - a) * 4))
        for name, m in p["methods"].items():
            keys = METHOD_KEYS | ({"r_calls_formula"} if name == "wfd-2" else set())
            assert m.keys() == keys and m["identical"] == 1
        assert table[j + 1].startswith(f"| {p['x']} |") and table[j + 1].endswith("| yes |")
    return saved, [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]


def png_size(path):
    image = pytest.importorskip("matplotlib.image",
                                reason="--plot needs matplotlib (requirements.txt)")
    return image.imread(path).shape[1::-1]


def test_sweep_acceptance(capsys, tmp_path):
    """Every point runs the drafting methods anew; AR's runs, which no draft touches, once."""
    saved, table = sweep(capsys, tmp_path, ["--sweep", "acceptance", "--points", "0.5,1",
                                           "--methods", "dtv,wfd", "--prompt-len", "4",
                                           "--plot", str(tmp_path / "a.png")])
    assert (saved["shown"] == ["ar", "dtv", "wfd"]
            and [p["x"] for p in saved["points"]] == [0.5, 1.0])
    first, last = saved["points"]
    assert last["acceptance"] == 1 and last["methods"]["dtv"]["acceptance"] == 1
    for name, m in last["methods"].items():
        reused = name.startswith("ar")
        assert m["measured_at_point"] == (0 if reused else 1)
        # AR's figures are the same run's
        assert (m["tok_s"] == first["methods"][name]["tok_s"]) == reused
    assert table[1][:3] == ["1.0", "1.000", "4.00x"]
    assert table[1][4] == table[0][4] + "*"  # AR's tok/s, marked as measured at an earlier point
    assert saved["ar_again_tok_s"] > 0  # and measured again at the end, to show the drift
    assert png_size(tmp_path / "a.png") == bench.figures.PIXELS
    # the saved points print the same table and draw the figure again, without a model
    out = bench.main(["--plot-from", str(tmp_path / "sweep-acceptance.json"),
                      "--plot", str(tmp_path / "b.png")])
    again = [[c.strip() for c in line.strip("|").split("|")]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert (out is None and again[1:] == table
            and png_size(tmp_path / "b.png") == bench.figures.PIXELS)


def test_sweep_draft_steps(capsys, tmp_path):
    """k over 1..T: WFD's width ceil(T / k) is 4, 2, 2, 1, so AR at that width (and its shared-KV
    window) runs at k = 1, 2 and 4, and k = 3 reuses k = 2's run; at k = 4 AR at width 1 is plain
    AR, whose run from k = 1 serves."""
    saved, _ = sweep(capsys, tmp_path, ["--sweep", "draft-steps", "--prompt-len", "4",
                                        "--methods", "wfd,wfd-shared",
                                        "--plot", str(tmp_path / "k.png")])
    points = saved["points"]
    assert [p["x"] for p in points] == [p["k"] for p in points] == [1, 2, 3, 4]
    assert [p["methods"]["wfd"]["width"] for p in points] == [4, 2, 2, 1]
    at = {"ar": [0, 0, 0, 0], "ar-wave": [0, 1, 1, 0], "ar-shared": [0, 1, 1, 3],
          "wfd": [0, 1, 2, 3]}
    for name in at:
        assert [p["methods"][name]["measured_at_point"] for p in points] == at[name]
    assert png_size(tmp_path / "k.png") == bench.figures.PIXELS


def test_sweep_length(capsys, tmp_path):
    """The prompt length changes AR too: every run is measured at every point."""
    saved, _ = sweep(capsys, tmp_path, ["--sweep", "length", "--points", "3,9", "--methods", "wfd"])
    assert [p["prompt_len"] for p in saved["points"]] == [3, 9]
    assert all(m["measured_at_point"] == j
               for j, p in enumerate(saved["points"]) for m in p["methods"].values())
    assert saved["ar_again_tok_s"] is None  # nothing reused, no drift to show
    assert ([p["prompt_source"] for p in saved["points"]]
            == [f"1 random-id prompts of {n} tokens" for n in (3, 9)])


@pytest.mark.parametrize("args, message", [
    # its points are --batch-sizes
    (["--sweep", "batch"], "argument --sweep: invalid choice: 'batch'"),
    (["--batch-sizes", "1,2", "--sweep", "acceptance"], "--batch-sizes is a sweep of its own"),
    (["--batch-sizes", "1,2", "--points", "1"], "--batch-sizes is a sweep of its own"),
    (["--batch-sizes", "1,2", "--batch-size", "2"],
     "--batch-sizes sets --batch-size at each point"),
    (["--model", OURO_A, "--num-prompts", "2", "--batch-sizes", "1,4"],
     "--batch-sizes must lie in 1..2 (the prompts), not 4"),
    (["--model", OURO_A, "--batch-sizes", "1,two"], "--batch-sizes takes comma-separated ints"),
    (["--model", OURO_A, "--num-prompts", "2", "--batch-size", "3"],
     "--batch-size 3 is more than the 2 prompts"),
    (["--plot", "x.png"], "--plot draws a sweep: give --sweep NAME"),
    (["--plot-from", "x.json", "--plot", "x.png", "--sweep", "acceptance"],
     "give it or --sweep, not both"),
    (["--points", "1,2"], "--points needs --sweep NAME"),
    (["--sweep", "acceptance", "--plot", os.path.join(OURO_A, "config.json", "x.png")],
     "cannot make the folder"),
    (["--sweep", "acceptance", "--acceptance", "0.5"],
     "sets --acceptance at each point: give the points with"),
    (["--sweep", "draft-steps", "--draft-steps", "2"], "sets --draft-steps at each point"),
    (["--sweep", "length", "--questions", "q.jsonl"], "not with --questions"),
    (["--model", OURO_A, "--sweep", "draft-steps", "--points", "1,5"], "must lie in 1..4, not 5"),
    (["--model", OURO_A, "--sweep", "acceptance", "--points", "0.5,high"],
     "comma-separated floats"),
    (["--plot-from", os.path.join(HERE, "testdata", "ouro_A", "config.json"), "--plot", "x.png"],
     "is not a bench.py sweep file"),
])
def test_sweep_refusals(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        bench.main(args + ["--out", ""])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    # after the loading log, if any
    assert exit_.value.code == 2 and len(errors) == 1 and message in errors[0]


def test_plot_without_matplotlib(capsys, monkeypatch):
    # its import fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--sweep", "acceptance", "--plot", "x.png"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == "error: --plot needs matplotlib, an optional dependency: pip install matplotlib\n"


@pytest.mark.slow
def test_bench_imports_no_matplotlib():
    """Nothing but --plot imports it: bench.py runs without it (a process of its own, since this
    one's tests import it)."""
    done = subprocess.run([sys.executable, "-c",
                           "import sys, bench; assert 'matplotlib' not in sys.modules"], cwd=ROOT)
    assert done.returncode == 0


# -- batches ---------------------------------------------------------------------------------------

def test_batch_size(capsys):
    """--batch-size 2 on 3 prompts (one slot refilled): every method identical to AR at its width
    through the same slots, and in float64 each prompt's tokens its own single-prompt AR's."""
    out, text = run_bench(capsys, ["--model", OURO_A, "--dtype", "float64", "--num-prompts", "3",
                                   "--prompt-len", "5", "--max-new-tokens", "8", "--warmup", "2",
                                   "--batch-size", "2", "--methods", "dtv,wfd", "--out", ""])
    assert ("greedy, batch 2 (slots refilled as sequences finish)" in text
            and bench.figures.BATCH_LEGEND in text)
    assert "Time per R call" not in text  # a batched call's time is not one prompt's
    table = rows(text)
    assert [r[0] for r in table.values()] == [bench.METHODS[n][3] for n in out["names"]]
    assert all(cells[-2] == "100%" for cells in table.values())
    model = models.load(OURO_A, dtype=torch.float64)
    for name in out["names"]:
        recs = out["results"][name]
        assert ([r["stats"]["slot"] for r in recs] == [0, 1, 0]
                and all(r["stats"]["batch_size"] == 2 for r in recs))
        tokens = sum(r["stats"]["tokens"] for r in recs)
        # the batch's throughput: its tokens over the call's time, which its last prompt's
        # batch_s holds
        assert out["figs"][name]["tok_s"] == pytest.approx(tokens / max(r["batch_s"] for r in recs))
        for r in recs:
            assert r["tokens"] == engine.generate(model, r["prompt"]["ids"], 8, method="ar",
                                                  width=1).tokens


def test_batch_emulated_acceptance_per_prompt(capsys):
    """The emulated drafts of each prompt come from that prompt's reference: at A = 1 every verified
    draft of every prompt is accepted, at A = 0 none (ouro_A's own drafts are all rejected)."""
    config = os.path.join(HERE, "testdata", "ouro_A", "config.json")
    for a in ("1.0", "0.0"):
        out, text = run_bench(capsys, ["--random-weights", config, "--acceptance", a,
                                       "--methods", "wfd", "--num-prompts", "3",
                                       "--prompt-len", "4", "--max-new-tokens", "10",
                                       "--warmup", "0", "--batch-size", "2", "--out", ""])
        assert all(r["stats"]["acceptance"] == float(a) for r in out["results"]["wfd"])
        assert all(cells[-2] == "100%" for cells in rows(text).values())


def test_sweep_batch(capsys, tmp_path):
    """--batch-sizes: the same prompts at every batch size, every run measured anew (a batch changes
    AR's calls too), one row per batch size."""
    saved, table = sweep(capsys, tmp_path, ["--batch-sizes", "1,3", "--num-prompts", "3",
                                           "--prompt-len", "4", "--methods", "wfd",
                                           "--plot", str(tmp_path / "b.png")])
    assert saved["sweep"] == "batch" and [p["x"] for p in saved["points"]] == [1, 3]
    assert all(m["measured_at_point"] == j
               for j, p in enumerate(saved["points"]) for m in p["methods"].values())
    assert saved["prompts"] == 3 and [row[0] for row in table] == ["1", "3"]
    assert png_size(tmp_path / "b.png") == bench.figures.PIXELS
    text = bench.figures.text(saved)
    assert "greedy, each point's batch" in text and bench.figures.BATCH_LEGEND in text
    assert f"UTC; {saved['machine']}, {saved['threads']} CPU thread(s); torch" in text
    # run on cuda:1: its GPU's name, no CPU threads
    assert "UTC; GPU one; torch" in bench.figures.text(dict(saved, device="cuda:1",
                                                            machine="GPU one"))


# -- the second proposal --------------------------------------------------------------------------

def test_second_depth_row_and_its_emulation(capsys):
    """--second-depth M adds the second proposal and its reference (AR through the same calls),
    each identical; with --acceptance A --second-acceptance B the drafts are right with
    probability A and the second proposals with B, coupled: every verify whose draft was wrong
    and second proposal right is a rescue."""
    config = os.path.join(HERE, "testdata", "ouro_A", "config.json")
    out, text = run_bench(capsys, ["--random-weights", config, "--acceptance", "0.5",
                                   "--second-acceptance", "1.0", "--draft-steps", "1",
                                   "--second-depth", "2", "--methods", "wfd", "--num-prompts",
                                   "3", "--prompt-len", "4", "--max-new-tokens", "24",
                                   "--warmup", "0", "--out", ""])
    table = rows(text)
    assert {"WFD, second proposal", "AR, second-proposal width"} <= table.keys()
    assert all(cells[-2] == "100%" for cells in table.values())
    two = out["figs"]["wfd-2"]
    assert two["acceptance"] + two["rescues"] == 1 and 0.2 < two["rescues"] < 0.8
    assert out["figs"]["wfd"]["rescues"] != out["figs"]["wfd"]["rescues"]  # NaN: no siblings
    assert two["r_per_token"] < out["figs"]["wfd"]["r_per_token"]
    assert "Second proposal at m=2: " in text and "by a*k + r*m + (1-a-r)*T" in text


@pytest.mark.slow
def test_sweep_second_depth(capsys, tmp_path):
    """m over k+1..T-1 (T = 4, k = 1: 2 and 3), the figure of R calls per token."""
    saved, _ = sweep(capsys, tmp_path, ["--sweep", "second-depth", "--prompt-len", "4",
                                        "--methods", "wfd", "--draft-steps", "1",
                                        "--plot", str(tmp_path / "m.png")])
    points = saved["points"]
    assert [p["x"] for p in points] == [2, 3]
    assert all(p["methods"]["wfd-2"]["r_calls_formula"] > 1 for p in points)
    assert png_size(tmp_path / "m.png") == bench.figures.PIXELS


def test_reference_rows(capsys):
    """The reference's rows (wfd.py's loop) beside the engine's: its AR gives the engine's AR's
    tokens, its WFD its AR's."""
    out, text = run_bench(capsys, ["--model", os.path.join(HERE, "testdata", "ouro_A"),
                                   "--num-prompts", "2", "--prompt-len", "5", "--methods",
                                   "ar,ref-wfd", "--max-new-tokens", "12", "--out", ""])
    table = rows(text)
    assert table["AR, the reference (wfd.py): a plain forward"][-2:] == ["100%", "100.0%"]
    assert table["WFD, the reference (wfd.py)"][-2:] == ["100%", "100.0%"]
    assert "The reference's AR (wfd.py's loop, eager: a plain forward" in text
