"""What a user types, at its edges: bytes that are not text, a byte-order mark, Ctrl-C in a sweep
and a sweep run again, a run resumed after an --overwrite cut short, refusals made before the model
loads, the wavefront's picture when Python gives a row's id to a later row, and messages that name
only flags, files and commands that exist."""
import json
import os
import re

import pytest
import torch

import bench
import cli.answers
import models
import run
from cli import args as cli_args
from cli.output import draw_wavefront
from formats import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OURO_A = os.path.join(HERE, "testdata", "ouro_A")


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the commands set one thread for the tiny models


def refused(capsys, script, argv):
    """The one line a command refuses argv with (exit status 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_:
        script.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.rstrip("\n")


# -- bytes ----------------------------------------------------------------------------------------

def test_bytes_that_are_not_text_are_one_line(capsys, tmp_path):
    """A byte that is not UTF-8 on the command line (Python reads it as a lone surrogate) or in a
    file, and a lone surrogate escaped in JSON: one line naming the flag, the file and the line."""
    assert refused(capsys, run, ["--prompt", "caf\udce9"]) == (
        "error: --prompt: not UTF-8 text (byte 0xe9 at character 3)")
    (tmp_path / "s.jsonl").write_text('{"prompt": "x"}\n{"prompt": "a\\ud800b"}\n')
    assert refused(capsys, run, ["--prompts-file", str(tmp_path / "s.jsonl")]) == (
        f"error: --prompts-file {tmp_path / 's.jsonl'} line 2: the prompt holds U+D800, a lone "
        "surrogate, which is not text")
    (tmp_path / "c.txt").write_bytes(b"ok\ncaf\xe9\n")
    assert refused(capsys, run, ["--prompts-file", str(tmp_path / "c.txt")]) == (
        f"error: --prompts-file {tmp_path / 'c.txt'} line 2: not UTF-8 text (byte 0xe9 at "
        "offset 6)")
    (tmp_path / "q.jsonl").write_text(
        json.dumps(dict(question_id=1, category="qa", turns=["Why?"])) + "\n"
        + '{"question_id": 2, "category": "qa", "turns": ["a\\udc00"]}\n')
    err = refused(capsys, bench, ["--questions", str(tmp_path / "q.jsonl"), "--out", ""])
    assert err == (f"error: --questions {tmp_path / 'q.jsonl'} line 2: the prompt holds U+DC00, a "
                   "lone surrogate, which is not text")


@pytest.mark.parametrize("name,line", [("b.txt", "def g(y):"),
                                       ("b.jsonl", json.dumps({"prompt": "def g(y):"}))])
def test_a_byte_order_mark_is_dropped(name, line, capsys, tmp_path):
    """A file that starts with a UTF-8 BOM gives the tokens of the same file without it."""
    outs = []
    for bom in (b"\xef\xbb\xbf", b""):
        path = tmp_path / name
        path.write_bytes(bom + line.encode() + b"\n")
        run.main(["--prompts-file", str(path), "--json", "--max-new-tokens", "3"])
        out = json.loads(capsys.readouterr().out)
        outs.append((out["prompt_ids"], out["tokens"]))
    assert outs[0] == outs[1]


# -- sweeps ---------------------------------------------------------------------------------------

SWEEP = ["--model", OURO_A, "--num-prompts", "1", "--prompt-len", "4", "--max-new-tokens", "6",
         "--warmup", "0", "--methods", "wfd", "--sweep", "acceptance", "--points", "0.5,0.9,1",
         "--threads", "1"]


def test_ctrl_c_in_a_sweep_keeps_its_points_and_resume_goes_on(capsys, tmp_path, monkeypatch):
    """Ctrl-C at the second point: status 130, the first point in sweep-acceptance.json and in the
    printed table; the same command again is refused (the file holds a sweep), --resume measures
    the other points and keeps the first as it was."""
    real, calls = bench.run_all, []

    def cut(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(bench, "run_all", cut)
    argv = SWEEP + ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 130
    path = tmp_path / "sweep-acceptance.json"
    assert err.splitlines()[-1] == (f"interrupted: the points that finished (1) are in {path}; "
                                    "the same command with --resume measures the rest")
    first = json.loads(path.read_text())
    assert [p["x"] for p in first["points"]] == [0.5]
    assert [line.split("|")[1].strip() for line in out.splitlines()
            if line.startswith("| ")][1:] == ["0.5"]
    monkeypatch.undo()
    assert refused(capsys, bench, argv) == (
        f"error: --out {tmp_path} holds a sweep of an earlier run (sweep-acceptance.json): "
        "--resume goes on with it, --overwrite starts again, or give another --out")
    assert json.loads(path.read_text()) == first
    done = bench.main(argv + ["--resume"])
    capsys.readouterr()
    saved = json.loads(path.read_text())
    assert saved == done and [p["x"] for p in saved["points"]] == [0.5, 0.9, 1.0]
    assert saved["points"][0] == first["points"][0]
    # another command's sweep is not resumed
    err = refused(capsys, bench, argv[:-4] + ["--points", "0.5,0.8", "--out", str(tmp_path),
                                               "--resume"])
    assert "holds a sweep of another run" in err


def answers(folder):
    """Each answer file's texts by question id."""
    return {name: {a["question_id"]: a["choices"][0]["turns"]
                   for a in map(json.loads, open(folder / name))}
            for name in sorted(os.listdir(folder))}


def test_a_run_resumed_after_an_overwrite_cut_short(capsys, tmp_path, monkeypatch):
    """A run, then --overwrite killed after its first answer, then --resume: the answers of an uncut
    run. --resume reads the answers --overwrite wrote as of the same run, so that neither flag may
    enter the run's fingerprint."""
    argv = ["--model", OURO_A, "--num-prompts", "3", "--prompt-len", "4", "--max-new-tokens", "6",
            "--warmup", "0", "--methods", "wfd", "--threads", "1", "--out"]
    bench.main(argv + [str(tmp_path / "uncut")])
    bench.main(argv + [str(tmp_path / "cut")])
    real, written = cli.answers.Answers.write, []

    def killed(self, *args):
        if written:
            raise KeyboardInterrupt
        written.append(real(self, *args))
    monkeypatch.setattr(cli.answers.Answers, "write", killed)
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv + [str(tmp_path / "cut"), "--overwrite"])
    assert exit_.value.code == 130
    monkeypatch.undo()
    bench.main(argv + [str(tmp_path / "cut"), "--resume"])
    capsys.readouterr()
    assert answers(tmp_path / "cut") == answers(tmp_path / "uncut")


# -- refusals before the model loads --------------------------------------------------------------

EARLY = {  # refusals that need no model: name -> (script, argv); TAKEN, SWEPT, FILE: the test makes
    "answers in --out": (bench, ["--out", "TAKEN"]),
    "a sweep in --out": (bench, ["--sweep", "acceptance", "--out", "SWEPT"]),
    "--out a file": (bench, ["--out", "FILE"]),
    "--points": (bench, ["--sweep", "acceptance", "--points", "a,b", "--out", ""]),
    "--capacity": (bench, ["--capacity", "10", "--out", ""]),
    "--methods ''": (bench, ["--methods", "", "--out", ""]),
    "--methods ref-wfd": (bench, ["--methods", "ref-wfd", "--temperature", "1", "--out", ""]),
    "--questions": (bench, ["--questions", "FILE", "--out", ""]),
    "--prompt": (run, ["--prompt", "caf\udce9"]),
    "--prompt-ids": (run, ["--prompt-ids", "1,a"]),
    "--eos": (run, ["--prompt", "x", "--eos", "2,a"]),
    "--chat --prompt-ids": (run, ["--chat", "--prompt-ids", "1"]),
    "--prompts-file": (run, ["--prompts-file", "FILE"]),
}


@pytest.mark.parametrize("name", EARLY)
def test_a_refusal_comes_before_the_model_loads(name, capsys, tmp_path, monkeypatch):
    """One line on stderr, with no loading said before it and no model loaded."""
    out = {"TAKEN": tmp_path / "taken", "SWEPT": tmp_path / "swept", "FILE": tmp_path / "file"}
    out["TAKEN"].mkdir()
    (out["TAKEN"] / "ouro_A-wfd.jsonl").write_text("{}\n")
    out["SWEPT"].mkdir()
    (out["SWEPT"] / "sweep-acceptance.json").write_text("{}")
    out["FILE"].write_bytes(b"caf\xe9\n")  # not UTF-8

    def load(*_, **__):
        raise AssertionError("the model loaded before the refusal")
    monkeypatch.setattr(models, "load", load)
    script, argv = EARLY[name]
    refused(capsys, script, ["--model", OURO_A] + (["--methods", "wfd"] * (script is bench))
            + [str(out.get(a, a)) for a in argv])


# -- the wavefront's picture ----------------------------------------------------------------------

# T = 4, k = 2: each position drafts at depth 2 and commits at 4. The row of position 12 takes the
# id (7) of position 10's, gone after its commit, as CPython's id() does; its draft is dropped and
# it starts again from depth 1, under the same id again
REUSED = [dict(rows=[(10, 1, 7, 5)]), dict(rows=[(10, 2, 7, 5)], drafted=[7]),
          dict(rows=[(10, 3, 7, 5), (11, 1, 8, 6)]),
          dict(rows=[(10, 4, 7, 5), (11, 2, 8, 6)], drafted=[8]),
          dict(rows=[(11, 3, 8, 6), (12, 1, 7, 9)], accepted=[8]),
          dict(rows=[(11, 4, 8, 6), (12, 2, 7, 9)], drafted=[7]),
          dict(rows=[(12, 1, 7, 9)])]


def test_the_wavefront_puts_each_row_on_its_own_line():
    """No cell lies on the line of a position committed before it, nor on another row's."""
    picture = draw_wavefront(REUSED, [5, 6, 9], 10, 4, 2, str)
    lines = [line.split() for line in picture.splitlines() if re.match(r"p(\+\d+)? ", line)]
    assert [line[:2] for line in lines] == [["p", "5"], ["p+1", "6"], ["p+2", "9"], ["p+2", "9"]]
    assert [line[2:] for line in lines] == [["1", "2d", "3", "4="], ["1", "2d", "3+", "4="],
                                            ["1", "2-d"], ["1"]], picture


# -- messages name what exists --------------------------------------------------------------------

@pytest.mark.parametrize("script", [run, bench])
def test_the_missing_demo_names_its_script(script, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "DEMO", str(tmp_path / "demo"))
    err = refused(capsys, script, ["--prompt", "x"] if script is run else ["--out", ""])
    command = re.search(r"build it with python (\S+)", err).group(1)
    assert os.path.isfile(os.path.join(ROOT, command)), err


def test_the_offline_hint_names_the_hubs_command():
    """huggingface_hub 1.x and later install `hf`, not huggingface-cli."""
    from huggingface_hub import errors
    hint = checkpoints.hub_error("a/b", errors.OfflineModeIsEnabled("offline"))
    assert "(hf download a/b)" in hint


def test_the_memory_hint_names_flags_that_exist():
    """Each flag the out-of-memory line names is one of both commands, or of the one named with
    it."""
    flags = {"run.py": vars(run.parse_args(["--prompt", "x"])),
             "bench.py": vars(bench.parse_args([]))}
    hint = cli_args.MEMORY_HINT
    own = re.findall(r"(\w+\.py) --([\w-]+)", hint)
    shared = re.findall(r"(?<!py) --([\w-]+)", hint)
    assert own and shared
    for script, flag in own:
        assert flag.replace("-", "_") in flags[script]
    for flag in shared:
        assert all(flag.replace("-", "_") in parsed for parsed in flags.values())


def test_plot_from_without_plot_prints_the_table(capsys, tmp_path):
    bench.main(SWEEP + ["--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert bench.main(["--plot-from", str(tmp_path / "sweep-acceptance.json")]) is None
    again = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and table == [line for line in again.splitlines()
                                         if line.startswith("| ")]


def test_method_all_labels_each_text_by_its_run(capsys):
    run.main(["--prompt", "def f(x):", "--method", "all", "--max-new-tokens", "3"])
    # the text's line of each run, not its stats line
    labels = re.findall(r"^\[([\w-]+)\] (?!\d+ tokens, )", capsys.readouterr().out, re.M)
    assert labels == ["ar1", "ar", "wfd", "ar-dtv", "dtv"]
