"""What a run at the paper's scale needs, on tiny models: memory that does not grow with the
prompts, timings without compiling, answers kept as they finish (and resumed), the model named from
any folder, one line for memory that runs out, the text the model wrote
(special tokens included)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders
from tokenizers import models as tokenizer_models

import bench
import models
import run
import wfd
from cli.output import answer_text
from runtime import memory
from test_chat import CHATML, checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the project
OURO_A = os.path.join(HERE, "testdata", "ouro_A")
slow = pytest.mark.slow


def tensors_in(x):
    if torch.is_tensor(x):
        return 1
    if isinstance(x, dict):
        return sum(map(tensors_in, x.values()))
    return sum(map(tensors_in, x)) if isinstance(x, (list, tuple)) else 0


def test_a_bench_run_keeps_no_logits(capsys):
    """Each result holds its logits as a digest: nothing in the results grows with the vocabulary,
    and a wrong logit is still caught (the digests differ)."""
    out = bench.main(["--model", OURO_A, "--num-prompts", "3", "--prompt-len", "4",
                      "--max-new-tokens", "6", "--methods", "ar,wfd", "--warmup", "0", "--out", "",
                      "--threads", "1"])
    assert tensors_in(out["results"]) == 0
    digests = [r["stats"]["logits_digest"] for r in out["results"]["wfd"]]
    assert (digests == [r["stats"]["logits_digest"] for r in out["results"]["ar-wave"]]
            and None not in digests)
    model = models.load(OURO_A)
    a = wfd.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True, keep_logits=True)
    b = wfd.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True)
    assert a.stats["logits_digest"] == b.stats["logits_digest"]
    model.lm_head.weight.data[0, 0] += 1e-3  # one logit of every row moves
    c = wfd.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True)
    assert c.tokens == a.tokens and c.stats["logits_digest"] != a.stats["logits_digest"]


PEAK_RSS = """
import resource, sys, bench
bench.main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@slow
def test_bench_memory_does_not_grow_with_the_prompts(tmp_path):
    """Peak RSS of a bench run at vocabulary 65536: 16 prompts within 1.1x of 4."""
    with open(os.path.join(HERE, "testdata", "huginn_A", "config.json")) as f:
        config = json.load(f)
    config.update(vocab_size=65536, padded_vocab_size=65536, block_size=128)
    (tmp_path / "config.json").write_text(json.dumps(config))
    peak = {}
    for n in (4, 16):
        argv = ["--random-weights", str(tmp_path / "config.json"), "--num-prompts", str(n),
                "--max-new-tokens", "48", "--methods", "ar,wfd", "--warmup", "0", "--out", "",
                "--threads", "1"]
        done = subprocess.run([sys.executable, "-c", PEAK_RSS] + argv, capture_output=True,
                              text=True, cwd=ROOT, timeout=900)
        assert done.returncode == 0, done.stderr
        peak[n] = int(done.stdout.splitlines()[-1])
    assert peak[16] <= 1.1 * peak[4], peak


@slow
def test_bench_compiled_timings_contain_no_compiling(tmp_path):
    """bench.py --compile, prompts of 8 tokens and 300 new ones across two buckets of the real key
    block (256): every answer of every method compiled nothing while timed;
    with --warmup 0 they do."""
    with open(os.path.join(OURO_A, "config.json")) as f:
        config = dict(json.load(f), max_position_embeddings=512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    compiled = {}
    for warmup in ("2", "0"):
        out = tmp_path / f"warmup{warmup}"
        done = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--random-weights",
                               str(tmp_path / "config.json"), "--num-prompts", "2",
                               "--prompt-len", "8", "--max-new-tokens", "300",
                               "--methods", "ar,wfd", "--compile", "--warmup", warmup,
                               "--out", str(out), "--threads", "1"],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr
        answers = [json.loads(line) for f in out.iterdir() for line in f.open()]
        assert len(answers) == 2 * 3 and all(a["bench"]["identical"] for a in answers)
        compiled[warmup] = [a["stats"]["graphs_compiled"] for a in answers]
        assert (("Graphs compiled during the timed runs: 0 (the warm-up" in done.stdout)
                == (warmup == "2"))
    assert compiled["2"] == [0] * 6 and sum(compiled["0"]) > 0


def test_paper_names_the_model_from_a_hub_cache_folder(tmp_path, capsys):
    """A Thinking checkpoint in the hub's cache layout gets the chat format and its own name."""
    folder = tmp_path / "models--ByteDance--Ouro-2.6B-Thinking" / "snapshots" / "0123abcd"
    folder.parent.mkdir(parents=True)
    os.rename(checkpoint(tmp_path, "ouro", tokenizer_config={"chat_template": CHATML}), folder)
    assert bench.model_name(str(folder)) == "Ouro-2.6B-Thinking"
    assert (bench.model_name("ByteDance/Ouro-2.6B") == "Ouro-2.6B"
            and bench.model_name(OURO_A) == "ouro_A")
    bench.main(["--paper", "--model", str(folder), "--per-category", "1", "--limit", "1",
                "--max-prompt-tokens", "16", "--max-new-tokens", "2", "--warmup", "0",
                "--dtype", "float32", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert ("chat template" in out
            and "The paper reports no Spec-Bench speedup for Ouro-2.6B-Thinking" in out)
    assert ("prompt format: chat (--prompt-format auto: Ouro-2.6B-Thinking is a Thinking model"
            in err)
    assert (tmp_path / "out" / "Ouro-2.6B-Thinking-wfd.jsonl").exists()


def test_weights_that_do_not_fit_are_refused_before_allocating(monkeypatch, capsys):
    monkeypatch.setattr(memory, "free_memory", lambda device: 1000)
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(SystemExit) as exit:
        run.main(["--model", OURO_A, "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: the weights need 0.00 GiB in float32, but cpu has 0.00 GiB free: "
                          "try a smaller dtype")


@pytest.mark.parametrize("script", [run, bench])
def test_running_out_of_memory_while_decoding_is_one_line(script, monkeypatch, capsys):
    def oom(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. "
                                     "GPU 0 has a total capacity "
                                     "of 15.70 GiB of which 1.10 GiB is free.\nMore text")
    monkeypatch.setattr(wfd.Decoder, "advance", oom)
    with pytest.raises(SystemExit) as exit:
        script.main(["--model", OURO_A, "--max-new-tokens", "4"]
                    + (["--prompt-ids", "1,2"] if script is run
                       else ["--num-prompts", "1", "--out", ""]))
    line = capsys.readouterr().err.splitlines()[-1]
    assert (exit.value.code == 2
            and line.startswith("error: out of memory: CUDA out of memory. Tried to allocate "
                                "2.00 GiB") and "try a smaller --batch-size" in line)


def test_stdlib_prompts_start_with_parcaes_bos():
    model = models.load(os.path.join(HERE, "testdata", "parcae_A"))
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ():\n_=.,", start=4)}
    tok = Tokenizer(tokenizer_models.WordPiece(vocab=dict(vocab, **{"[UNK]": 3}),
                                               unk_token="[UNK]"))
    tok.add_special_tokens(["<|bos|>"])
    model.tokenizer = tok
    bos = tok.token_to_id("<|bos|>")
    prompts = bench.stdlib_prompts(model, 1, length=6)
    assert prompts and all(p["ids"][0] == bos and bos not in p["ids"][1:] for p in prompts)


def test_the_text_keeps_the_special_tokens_but_the_stop(tmp_path, capsys):
    """A tokenizer whose special tokens <think> and </think> are two ids that ouro_A's greedy
    continuation writes, and a third its stop token: printed, streamed and JSON text keep the first
    two and leave out the stop token."""
    model = models.load(OURO_A)
    tokens = wfd.generate(model, [1, 2, 3], 12, method="ar").tokens
    think, end = tokens[2], next(t for t in tokens[3:] if t != tokens[2])
    stop = next(t for t in tokens[tokens.index(end) + 1:] if t not in (think, end))
    special = {think: "<think>", end: "</think>", stop: "<|im_end|>"}
    vocab = {f"t{i}": i for i in range(model.args.vocab_size) if i not in special}
    tok = Tokenizer(tokenizer_models.WordLevel(
        vocab=dict(vocab, **{n: i for i, n in special.items()}), unk_token="t0"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special.values()))
    folder = tmp_path / "thinking"
    models.save(model, folder)
    tok.save(str(folder / "tokenizer.json"))
    upto = tokens[:tokens.index(stop)]
    want = "".join(special.get(t, f"t{t}") for t in upto)
    assert "<think>" in want and "</think>" in want
    argv = ["--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "12",
            "--eos", str(stop), "--method", "ar"]
    run.main(argv)
    assert capsys.readouterr().out.splitlines()[0] == "t1t2t3" + want  # the prompt, then the answer
    run.main(argv + ["--json"])
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["text"] == want and json.loads(line)["tokens"][-1] == stop
    assert answer_text(tok, upto + [stop], stop) == want


def test_gpu_check_runs_the_interpreter_it_is_given(tmp_path):
    """STEPS names steps, PYTHON the interpreter: a fake one records its calls."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), STEPS="huginn ouro", RESULTS=str(tmp_path / "results"))
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--smoke"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("bench.py --random-weights tests/testdata/")
                                   for c in calls)
    assert (tmp_path / "results" / "steps.txt").read_text().splitlines() == [
        "huginn: exit 0 in 0 s", "ouro: exit 0 in 0 s"]


def bench_args(out, *extra):
    return ["--model", OURO_A, "--num-prompts", "3", "--prompt-len", "4", "--max-new-tokens", "20",
            "--warmup", "0", "--methods", "ar,wfd", "--threads", "1", "--out", str(out), *extra]


def interrupt(cmd, ready):
    """Runs cmd, sends SIGINT once ready() holds, and returns (status, stderr)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.time() + 120
    while not ready() and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    return p.returncode, err


def test_an_interrupted_bench_keeps_its_answers_and_resumes(tmp_path, capsys):
    """SIGINT to a bench.py process after its first answer: status 130, one line, the finished
    answers kept; --resume (run in this process) measures the rest, and refuses other flags."""
    wfd_file = tmp_path / "ouro_A-wfd.jsonl"
    status, err = interrupt([sys.executable, os.path.join(ROOT, "bench.py")] + bench_args(tmp_path),
                            lambda: wfd_file.exists() and wfd_file.stat().st_size)
    assert status == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("interrupted: the finished answers are in ")
    lines = {n: (tmp_path / f"ouro_A-{n}.jsonl").read_text().splitlines()
             for n in ("ar", "ar-wave", "wfd")}
    finished = len(lines["wfd"])
    assert 1 <= finished < 3 and all(len(v) >= finished for v in lines.values())
    bench.main(bench_args(tmp_path, "--resume"))
    out = capsys.readouterr().out
    assert f"### overall (3 prompts, {finished} of them resumed from " in out
    for n in ("ar", "ar-wave", "wfd"):
        ids = [json.loads(line)["question_id"] for line in (tmp_path / f"ouro_A-{n}.jsonl").open()]
        assert sorted(ids) == list(range(3)), n
    assert "| WFD | 4 |" in out and "| 100% |" in out
    with pytest.raises(SystemExit) as exit:
        bench.main(bench_args(tmp_path, "--resume", "--max-new-tokens", "21"))
    assert exit.value.code == 2 and "holds answers of another run" in capsys.readouterr().err


def test_an_interrupted_run_py_is_one_line_and_status_130():
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), "--prompt", "def f(x):",
           "--max-new-tokens", "200"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stdout.read(9) == b"def f(x):"  # streaming has begun
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.decode() == "interrupted\n"
