"""The command line as a user meets it: every mistake is one line on stderr and exit status 2,
before any output; --json is strict JSON; streamed text is whole characters."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

import bench
import models
import run
import engine
from cli import figures
from formats import chat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the project
OURO_A = os.path.join(HERE, "testdata", "ouro_A")
PARCAE_A = os.path.join(HERE, "testdata", "parcae_A")


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run.main sets one thread for the demo


def nan_weights(data):
    """200 KB of 0xFF past the header: NaN in fp32."""
    start = 8 + int.from_bytes(data[:8], "little") + 4096
    return data[:start] + b"\xff" * 200_000 + data[start + 200_000:]


DAMAGE = {
    "config": ("config.json", lambda d: d[:-10]),
    "truncated": ("model.safetensors", lambda d: d[:len(d) // 2]),
    "header": ("model.safetensors", lambda d: d[:8] + b"\x00" * 64 + d[72:]),
    "tokenizer": ("tokenizer.json", lambda d: d[:1000]),
    "nan": ("model.safetensors", nan_weights),
}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """Copies of the demo model, each with one file damaged."""
    folders = {}
    for name, (file, damage) in DAMAGE.items():
        folder = tmp_path_factory.mktemp(name)
        shutil.copytree(run.DEMO, folder, dirs_exist_ok=True)
        path = folder / file
        path.write_bytes(damage(path.read_bytes()))
        folders[name] = str(folder)
    return folders


PROMPT_FILES = {  # name: content, each with one mistake (a line's named by its number)
    "not-json.jsonl": '{"prompt": "x"}\nnot json\n',
    "no-prompt.jsonl": '{"prompt": "x"}\n\n{"text": "y"}\n',
    "both.jsonl": '{"prompt": "x", "prompt_ids": [1]}\n',
    "list.jsonl": "[1, 2]\n",
    "empty-text.jsonl": '{"prompt": ""}\n',
    "bad-ids.jsonl": '{"prompt_ids": [1, "a"]}\n',
    "empty-ids.jsonl": '{"prompt_ids": [1]}\n{"prompt_ids": []}\n',
    "vocab.jsonl": '{"prompt_ids": [1, 2048]}\n',
    "ids.jsonl": '{"prompt_ids": [1, 2]}\n',
    "long.txt": "x = 1\n\n" + "y " * 300 + "\n",
    "blank.txt": "\n  \n\n",
    "two.txt": "a\nb\n",
    "binary.txt": b"\x89PNG\r\n\x1a\n\x00\x00",
    "latin-1.txt": b"ok\ncaf\xe9\n",
    "surrogate.jsonl": '{"prompt": "x"}\n{"prompt": "a\\ud800b"}\n',
    "q.jsonl": json.dumps(dict(question_id=1, category="qa", turns=["Why?"])) + "\n",
    "no-points.json": json.dumps(dict(dict.fromkeys(figures.KEYS, ""), sweep="length", points=[])),
}


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    for name, content in PROMPT_FILES.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (folder / "folder").mkdir()
    return {name: str(folder / name) for name in [*PROMPT_FILES, "folder"]}


CASES = [  # (script, arguments, what the one line says)
    (run, ["--prompt", ""], "the prompt is empty"),
    (run, ["--prompt-ids", "a,b"], "--prompt-ids takes comma-separated integers"),
    (run, ["--prompt-ids=-1"], "prompt token -1 is outside the vocabulary"),
    (run, ["--prompt-ids", "1,2048"], "prompt token 2048 is outside the vocabulary"),
    (run, ["--prompt-ids", ",".join(["1"] * 300)], "exceeds the model's context of 256"),
    (run, ["--prompt", "x", "--draft-steps", "0"], "draft depth 0 is out of range"),
    (run, ["--prompt", "x", "--draft-steps", "99"], "draft depth 99 is out of range"),
    (run, ["--prompt", "x", "--steps", "0"], "^error: --steps must be at least 1"),
    (run, ["--prompt", "x", "--max-new-tokens", "0"],
     "^error: --max-new-tokens must be a positive integer"),
    (run, ["--prompt", "x", "--draft-len", "0"], "^error: --draft-len must be at least 1"),
    (run, ["--prompt", "x", "--top-k", "0"], r"^error: --top-k must be an integer >= 1, not 0$"),
    (run, ["--prompt", "x", "--temperature", "1", "--top-p", "2"],
     r"^error: --top-p must be in \(0, 1\], not 2.0$"),
    (run, ["--prompt", "x", "--temperature", "-1"], "^error: --temperature must be a finite"),
    (run, ["--prompt", "x", "--seed", "-1"], "^error: --seed must be at least 0, not -1"),
    (run, ["--prompt", "x", "--width", "1"], "^error: --width 1 is too small"),
    (run, ["--prompt", "x", "--method", "dtv", "--second-depth", "3"],
     r"^error: --second-depth is the wavefront's second proposal: --method wfd \(or ar, "
     ".*not dtv$"),
    (run, ["--prompt", "x", "--max-new-tokens", "100000"], "exceeds the model's context"),
    (run, ["--prompt", "x", "--threads", "-2"], "--threads must be at least 1"),
    (run, ["--prompt", "x", "--engine", "reference", "--temperature", "0.5"],
     "^error: --temperature is the engine's: --engine reference runs wfd.py's plain loop"),
    (run, ["--prompt", "x", "--engine", "reference", "--compile"],
     "^error: --compile is the engine's"),
    (run, ["--prompt", "x", "--engine", "reference", "--method", "dtv", "--kv", "shared"],
     "^error: --kv shared is not exact for draft-then-verify"),
    (run, ["--prompt", "x", "--eos", "2,a"], "--eos takes comma-separated integers"),
    (run, ["--prompt", "x", "--eos", "5000"], "^error: --eos 5000 is outside the vocabulary"),
    (run, ["--prompt", "x", "--method", "dtv", "--kv", "shared"],
     "^error: --kv shared is not exact for draft-then-verify.*; use --kv full$"),
    (run, ["--prompt", "x", "--steps", "four"], "argument --steps: invalid int value"),
    (run, ["--prompt", "x", "--model", "./demo2"],
     "^error: --model: no such model folder: ./demo2"),
    (run, ["--prompt", "x", "--model", "nobody/no-such-model"],
     "^error: --model: could not get 'nobody/no-such-model' from the Hugging Face hub: the hub "
     "cannot be reached from here .* give the local folder's path instead of the id$"),
    (run, ["--prompt", "x", "--model", "binary.txt"],
     "^error: --model: .*binary.txt is a file, not a model folder"),
    (run, ["--prompt", "x", "--model", "folder"], "^error: --model: no config.json in .*folder"),
    (run, ["--prompt", "x", "--device", "cuda"], "device 'cuda': this torch .* has no CUDA"),
    (run, ["--prompt", "x", "--device", "cuda:1"], "device 'cuda:1': this torch .* has no CUDA"),
    (run, ["--prompt", "x", "--device", "gpu"], "'gpu' is not a device: give cpu, cuda or cuda:N"),
    (run, ["--prompt", "x", "--model", OURO_A],
     "has no tokenizer.json: pass --tokenizer, or --prompt-ids"),
    (run, ["--prompt", "x", "--tokenizer", "./no_such_tokenizer"],
     "no such tokenizer file or folder: ./no_such_tokenizer"),
    (run, ["--prompt", "x", "--tokenizer", OURO_A],
     "^error: --tokenizer: no tokenizer.json in .*ouro_A"),
    (run, ["--prompt", "x", "--tokenizer", "binary.txt"],
     "^error: --tokenizer: .*binary.txt is not a tokenizer.json"),
    (run, ["--prompt", "x", "--model", "config"], r"config\.json is not valid JSON"),
    (run, ["--prompt", "x", "--model", "truncated"],
     r"model\.safetensors is not a readable safetensors file"),
    (run, ["--prompt", "x", "--model", "header"],
     r"model\.safetensors is not a readable safetensors file"),
    (run, ["--prompt", "x", "--model", "tokenizer"], r"tokenizer\.json is not a tokenizer\.json"),
    (run, ["--prompt", "x", "--model", "nan"],
     r"tensor '[\w.]+' in .*model\.safetensors holds NaN or inf"),
    (run, ["--prompts-file", "not-json.jsonl"], r"not-json\.jsonl line 2: not JSON"),
    (run, ["--prompts-file", "no-prompt.jsonl"],
     r"line 3: each line must be a JSON object with \"prompt\""),
    (run, ["--prompts-file", "both.jsonl"],
     r"line 1: each line must be a JSON object with \"prompt\""),
    (run, ["--prompts-file", "list.jsonl"], r"line 1: each line must be a JSON object"),
    (run, ["--prompts-file", "empty-text.jsonl"], r"line 1: \"prompt\" must be a non-empty string"),
    (run, ["--prompts-file", "bad-ids.jsonl"],
     r"line 1: \"prompt_ids\" must be a list of integers"),
    (run, ["--prompts-file", "empty-ids.jsonl"], r"empty-ids\.jsonl line 2: the prompt is empty"),
    (run, ["--prompts-file", "vocab.jsonl"],
     r"line 1: prompt token 2048 is outside the vocabulary"),
    (run, ["--prompts-file", "long.txt"],
     r"long\.txt line 3: prompt \(\d+ tokens\) \+ --max-new-tokens \(128\)"),
    (run, ["--prompts-file", "blank.txt"], r"blank\.txt holds no prompt"),
    (run, ["--prompts-file", "no_such.txt"],
     "^error: --prompts-file no_such.txt: No such file or directory$"),
    (run, ["--prompts-file", "binary.txt"],
     r"^error: --prompts-file .*binary.txt line 1: not UTF-8 text \(byte 0x89 at offset 0\)$"),
    (run, ["--prompts-file", "latin-1.txt"],
     r"^error: --prompts-file .*latin-1.txt line 2: not UTF-8 text \(byte 0xe9 at offset 6\)$"),
    (run, ["--prompts-file", "surrogate.jsonl"],
     r"^error: --prompts-file .*surrogate.jsonl line 2: the prompt holds U\+D800, a lone "
     "surrogate"),
    (run, ["--prompt", "caf\udce9"],
     r"^error: --prompt: not UTF-8 text \(byte 0xe9 at character 3\)$"),
    (run, ["--prompts-file", "folder"], "^error: --prompts-file .*folder: Is a directory$"),
    (run, ["--prompts-file", "two.txt", "--batch-size", "0"], "--batch-size must be at least 1"),
    (run, ["--prompt", "x", "--batch-size", "2"], "--batch-size needs --prompts-file"),
    (run, ["--prompts-file", "two.txt", "--prompt", "x"],
     "argument --prompt: not allowed with argument --prompts-file"),
    (run, ["--prompts-file", "two.txt", "--method", "all"],
     "for --method all on many prompts use bench.py"),
    (run, ["--prompts-file", "ids.jsonl", "--chat"], "line 1: --chat formats text prompts"),
    (run, ["--prompts-file", "two.txt", "--model", OURO_A], r"line 1: .* has no tokenizer\.json"),
    (bench, ["--limit", "0"], "--limit must be at least 1"),
    (bench, ["--batch-size", "0"], "--batch-size must be at least 1"),
    (bench, ["--methods", "wfd,beam"], "unknown method 'beam'"),
    (bench, ["--limit", "1", "--draft-steps", "9"], "draft depth 9 is out of range"),
    (bench, ["--random-weights", "no_such.json"],
     "^error: --random-weights no_such.json: No such file or directory$"),
    (bench, ["--random-weights", "binary.txt"],
     "^error: --random-weights: .*binary.txt is not valid JSON"),
    (bench, ["--questions", "binary.txt"],
     r"^error: --questions .*binary.txt line 1: not UTF-8 text \(byte 0x89 at offset 0\)$"),
    (bench, ["--questions", "q.jsonl", "--categories", "qa,nosuch"],
     r"^error: --categories nosuch: no question of .*q\.jsonl has it; its categories: qa$"),
    (bench, ["--methods", ""], "^error: --methods names no method: choose from ar, "),
    (bench, ["--out", "binary.txt"], r"^error: --out .*binary\.txt is a file: give a folder"),
    (bench, ["--seed", "-1"], "^error: --seed must be at least 0, not -1"),
    (bench, ["--model", "nobody/no-such-model"],
     "^error: --model: could not get 'nobody/no-such-model' from the Hugging Face hub: the hub "
     "cannot be reached"),
    (bench, ["--paper", "--random-weights", "x.json"],
     "--paper runs the Spec-Bench questions through a checkpoint's"),
    (bench, ["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
    (bench, ["--tokenizer", "tokenizer"], r"^error: --tokenizer: .*tokenizer\.json is not a"),
    (bench, ["--questions", "q.jsonl", "--model", OURO_A],
     r"--questions needs the model's tokenizer\.json"),
    (bench, ["--questions", "two.txt"], r"two\.txt line 1 is not a Spec-Bench question"),
    (bench, ["--plot-from", "two.txt", "--plot", "x.png"], r"two\.txt is not JSON"),
    (bench, ["--plot-from", "no-points.json", "--plot", "x.png"],
     r"no-points\.json holds no points of a sweep of acceptance"),
]


@pytest.mark.parametrize("script,argv,message", CASES, ids=[" ".join(c[1])[:40] for c in CASES])
def test_a_mistake_is_one_line_and_status_2(script, argv, message, damaged, prompt_files, capsys,
                                            monkeypatch):
    import huggingface_hub.constants
    # never reach out from a test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [damaged.get(a, prompt_files.get(a, a)) for a in argv]
    with pytest.raises(SystemExit) as exit:
        script.main(argv + (["--out", ""] if script is bench and "--out" not in argv else []))
    out, err = capsys.readouterr()
    assert exit.value.code == 2
    assert out == ""  # refused before the prompt is streamed
    *log, line = err.splitlines()  # bench.py may have logged its loading first
    assert line.startswith("error: ") and re.search(message, line)
    assert (script is bench and all(not line.startswith(("Traceback", "error")) for line in log)
            or not log)


def test_no_traceback_at_the_process_level(damaged):
    for argv in (["--prompt", "def f(x):", "--model", damaged["nan"]],):  # the others: in-process
        p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py")] + argv,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_an_offline_hub_id_is_one_line(tmp_path):
    """A hub id with the hub out of reach (HF_HUB_OFFLINE, an empty cache): one line naming the
    flag and the id, that the hub cannot be reached, and how to give a local folder."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "none"),
               HF_HUB_CACHE=str(tmp_path / "none" / "hub"))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--model",
                        "ByteDance/Ouro-2.6B", "--prompt", "x"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: --model: could not get 'ByteDance/Ouro-2.6B' from the "
                               "Hugging Face hub: the hub cannot be reached from here")
    assert "give the local folder's path instead of the id" in p.stderr and len(p.stderr) < 400


@pytest.mark.parametrize("script", ["run.py", "bench.py"])
def test_ctrl_c_while_torch_imports_is_one_line_and_status_130(script):
    """SIGINT while the modules import (torch takes a second or more): one line, status 130.
    -X importtime reports each import as it ends, so the signal is sent once torch's own modules
    have begun to arrive, with torch itself still importing."""
    p = subprocess.Popen([sys.executable, "-X", "importtime", os.path.join(ROOT, script),
                          "--prompt", "x"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if re.search(r"\|\s+torch\.", line):
            break
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    assert p.wait(timeout=60) == 130, rest
    assert not re.search(r"\|\s*torch$", "".join(seen), re.M)  # torch had not finished importing
    mine = [line for line in rest.splitlines() if not line.startswith("import time:")]
    assert mine == ["interrupted"], rest[-2000:]


def test_a_closed_pipe_ends_quietly():
    """`run.py ... | head -c 9`: the reader closes the pipe mid-stream; run.py stops with nothing on
    stderr and the status of a process that SIGPIPE ends (141), as a shell pipeline expects.
    float64 on one thread: seconds of decoding left when the pipe closes."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--prompt", "def f(x):",
                          "--max-new-tokens", "200", "--dtype", "float64", "--threads", "1"],
                         cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(9) == b"def f(x):"
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def strict(line):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_json_is_strict_for_every_method(capsys):
    run.main(["--prompt-ids", "1,2,3", "--json", "--method", "all", "--max-new-tokens", "6"])
    out = [strict(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["method"] for o in out] == ["ar1", "ar", "wfd", "ar-dtv", "dtv"]
    assert all(o["tokens"] == out[0]["tokens"] and o["stats"]["tokens"] == len(o["tokens"])
               for o in out)
    assert out[0]["stats"]["acceptance"] is None and isinstance(out[0]["text"], str)
    run.main(["--prompt-ids", "1,2,3", "--json", "--method", "all", "--kv", "shared",
              "--max-new-tokens", "6"])
    captured = capsys.readouterr()
    out = [strict(line) for line in captured.out.splitlines()]
    assert [o["method"] for o in out] == ["ar1", "ar", "wfd"] and "skipping dtv" in captured.err
    assert out[2]["stats"]["window"] == 2


def test_the_reference_says_whether_its_schedules_gave_its_ar(capsys):
    """--engine reference --method all: wfd.py's AR, WFD and DtV, and the verdict on their tokens;
    with one method, its text streamed and its stats line."""
    run.main(["--prompt", "def f(n):", "--engine", "reference", "--method", "all",
              "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert "[reference wfd] 12 tokens" in out and "[reference dtv] 12 tokens" in out
    assert out.rstrip().endswith("reference: WFD and DtV gave AR's tokens: yes")
    run.main(["--prompt", "def f(n):", "--engine", "reference", "--max-new-tokens", "12"])
    assert "[reference wfd] 12 tokens, " in capsys.readouterr().out


def test_the_text_and_stats_lines(capsys):
    demo = models.load(run.DEMO)
    ids = demo.tokenizer.encode("def f(x):").ids
    run.main(["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "4", "--steps", "4",
              "--method", "ar"])
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and "k=4 width 2, acceptance -," in out
    run.main(["--prompt", "def f(x):", "--max-new-tokens", "4", "--steps", "4", "--kv", "shared"])
    assert "T=4 k=2 width 2," in (out := capsys.readouterr().out) and "(shared, window 2)" in out


def test_streaming_prints_whole_characters(capsys):
    demo = models.load(run.DEMO)
    text = "x = '中文 🙂'  # ok"
    ids = demo.tokenizer.encode(text).ids
    assert "\ufffd" in demo.tokenizer.decode(ids[:5])  # a character cut between tokens
    stream, printed = run.TextStream(demo.tokenizer, ids[:1]), ""
    for t in ids[1:]:
        stream.add(t)
        printed += capsys.readouterr().out
        assert "\ufffd" not in printed
    stream.show()
    assert printed + capsys.readouterr().out == text + "\n"
    run.main(["--prompt", text, "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert out.startswith(text) and "\ufffd" not in out


def test_a_tokenizer_from_elsewhere(tmp_path, capsys):
    """--tokenizer for a folder without one (Parcae's): the prompt after <|bos|>, which that
    tokenizer does not add itself, and generation stopping at the token named <|eos|>
    (the config names none)."""
    model = models.load(PARCAE_A)
    prompt = [0, 5, 9, 3]
    eos = engine.generate(model, prompt, 30, method="ar").tokens[4]
    names = {0: "<|bos|>", eos: "<|eos|>"}
    vocab = {names.get(i, f"w{i}"): i for i in range(model.args.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    run.main(["--model", PARCAE_A, "--tokenizer", str(tmp_path / "tokenizer.json"),
              "--prompt", "w5 w9 w3", "--max-new-tokens", "30", "--method", "ar", "--json"])
    out = strict(capsys.readouterr().out)
    want = engine.generate(model, prompt, 30, method="ar", eos_token_id=eos).tokens
    assert out["tokens"] == want and want[-1] == eos and len(want) < 30


# -- many prompts: --prompts-file ------------------------------------------------------------------


def test_the_readmes_prompts_file_command_runs(capsys):
    """The README's --prompts-file command, as written (16 new tokens instead of 128, for time),
    on the prompts file the project ships: one JSON line per prompt."""
    with open(os.path.join(ROOT, "README.md")) as f:
        line = next(line for line in f if line.startswith("python run.py --prompts-file "))
    argv = shlex.split(line.split("#")[0])[2:]
    path = argv[argv.index("--prompts-file") + 1]
    with open(os.path.join(ROOT, path)) as f:
        n = sum(1 for line in f if line.strip())
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # the README's commands run in the project
        run.main(argv + ["--max-new-tokens", "16"])
    finally:
        os.chdir(cwd)
    out = [strict(line) for line in capsys.readouterr().out.splitlines()]
    assert n >= 4 and sorted(o["index"] for o in out) == list(range(n))


LINES = ["def f(x):", "import os", "class A:"]


def test_a_prompts_file(tmp_path, capsys):
    """Text lines (a blank one skipped) through 2 slots: one JSON object per prompt, in float64 each
    with its own single-prompt AR's tokens; the text output prints each answer with its index."""
    path = tmp_path / "prompts.txt"
    path.write_text(f"{LINES[0]}\n\n{LINES[1]}\n{LINES[2]}\n")
    argv = ["--prompts-file", str(path), "--batch-size", "2", "--max-new-tokens", "6",
            "--dtype", "float64"]
    run.main(argv + ["--json"])
    out = sorted((strict(line) for line in capsys.readouterr().out.splitlines()),
                 key=lambda o: o["index"])
    demo = models.load(run.DEMO, dtype=torch.float64)
    assert [o["index"] for o in out] == [0, 1, 2]
    for o, line in zip(out, LINES):
        ids = demo.tokenizer.encode(line).ids
        assert o["prompt_ids"] == ids and o["method"] == "wfd"
        assert o["tokens"] == engine.generate(demo, ids, 6, method="ar", width=1).tokens
        assert o["text"] == demo.tokenizer.decode(o["tokens"])
        assert o["stats"]["index"] == o["index"] and o["stats"]["batch_size"] == 2
        assert o["stats"]["slot"] == o["index"] % 2
    run.main(argv)
    text = capsys.readouterr().out
    for o in out:
        i = o["index"]
        assert f"[prompt {i}] {o['text']}\n[wfd, prompt {i}, slot {i % 2}] 6 tokens," in text
    assert (text.endswith("\n")
            and "[wfd] 3 prompts through 2 slots: 18 tokens in " in text.splitlines()[-1])


def test_a_jsonl_prompts_file(tmp_path, capsys):
    """JSONL: token ids for a model without a tokenizer, all prompts in one batch by default."""
    path = tmp_path / "prompts.jsonl"
    prompts = [[0, 5, 9], [3], [7, 7, 7, 7, 1]]
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    run.main(["--model", OURO_A, "--prompts-file", str(path), "--max-new-tokens", "5",
              "--dtype", "float64", "--method", "ar", "--json"])
    out = sorted((strict(line) for line in capsys.readouterr().out.splitlines()),
                 key=lambda o: o["index"])
    model = models.load(OURO_A, dtype=torch.float64)
    assert [o["prompt_ids"] for o in out] == prompts and all(o["text"] is None for o in out)
    for o, p in zip(out, prompts):
        assert o["tokens"] == engine.generate(model, p, 5, method="ar", width=1).tokens
        assert o["stats"]["batch_size"] == 3 and o["stats"]["slot"] == o["index"]


def test_chat_formats_each_prompt(tmp_path, capsys):
    """--chat with a prompts file: each text line as its own user turn,
    stopping at the end of a turn."""
    from test_chat import CHATML, checkpoint
    folder = checkpoint(tmp_path, "ouro", tokenizer_config={"chat_template": CHATML})
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi there"}) + "\n"
                    + json.dumps({"prompt": "line\nbreak"}) + "\n")
    run.main(["--model", folder, "--prompts-file", str(path), "--chat", "--max-new-tokens", "3",
              "--json"])
    out = sorted((strict(line) for line in capsys.readouterr().out.splitlines()),
                 key=lambda o: o["index"])
    model = models.load(folder)
    for o, text in zip(out, ["hi there", "line\nbreak"]):
        ids, stop = chat.chat_prompt(model, text)
        assert o["prompt_ids"] == ids and o["stats"]["eos_token_ids"] == sorted(stop)
