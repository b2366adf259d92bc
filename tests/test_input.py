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
import run
from cli import args as cli_args
from cli.output import draw_wavefront
from formats import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OURO_A = os.path.join(HERE, "testdata", "ouro_A")


@pytest.fixture(autouse=True)
def one_thread():
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
    lines = [line.split() for line in picture.splitlines() if line.startswith("#")]
    assert [line[:2] for line in lines] == [["#1", "5"], ["#2", "6"], ["#3", "9"], ["#3", "9"]]
    assert [line[2:] for line in lines] == [["1", "2d", "3", "4="], ["1", "2d", "3+", "4="],
                                            ["1", "2-d"], ["1"]], picture


# -- messages name what exists --------------------------------------------------------------------

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


def test_method_all_labels_each_text_by_its_run(capsys):
    run.main(["--prompt", "def f(x):", "--method", "all", "--max-new-tokens", "3"])
    # the text's line of each run, not its stats line
    labels = re.findall(r"^\[([\w-]+)\] (?!\d+ tokens, )", capsys.readouterr().out, re.M)
    assert labels == ["ar1", "ar", "wfd", "ar-dtv", "dtv"]
