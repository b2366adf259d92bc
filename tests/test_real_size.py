"""What a run at the paper's scale needs, on tiny models: memory that does not grow with the
prompts, timings without compiling, answers kept as they finish (and resumed), the model named from
any folder, one line for memory that runs out, the text the model wrote
(special tokens included)."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError
from tokenizers import Tokenizer, decoders
from tokenizers import models as tokenizer_models

import bench
import models
import run
import engine
from cli.output import answer_text
from formats import checkpoints, devices
from engine import model_runner
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
    a = engine.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True, keep_logits=True)
    b = engine.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True)
    assert a.stats["logits_digest"] == b.stats["logits_digest"]
    V = model.args.vocab_size
    for v in (0, V - 1, random.Random(0).randrange(1, V - 1)):  # the ends and one between
        weight = model.lm_head.weight.data[v, 0].item()
        model.lm_head.weight.data[v, 0] += 1e-3  # logit v of every row moves
        c = engine.generate(model, [1, 2, 3], 6, method="ar", digest_logits=True)
        model.lm_head.weight.data[v, 0] = weight
        assert c.tokens == a.tokens and c.stats["logits_digest"] != a.stats["logits_digest"], v


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
    monkeypatch.setattr(devices, "free_memory", lambda device: 1000)
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(SystemExit) as exit:
        run.main(["--model", OURO_A, "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: the weights need 0.00 GiB in float32, but cpu has 0.00 GiB free: "
                          "try a smaller dtype")


@pytest.mark.parametrize("name", ["huginn_A", "ouro_A", "parcae_A", "loopformer_A"])
def test_weights_are_allocated_once_and_the_dtype_read_from_the_header(name, monkeypatch):
    """from_config allocates each parameter once, the tied head no second time (to_empty would
    give it storage of its own until tied again: 0.7 GB for huginn-0125); the checkpoint's dtype
    comes from its header (or the mapped pickle), no tensor read (huginn-0125's embedding: 692
    MB)."""
    ckpt = checkpoints.Checkpoint(os.path.join(HERE, "testdata", name))
    a = models.ModelArgs.from_config(ckpt.config, ckpt.weights.keys())
    monkeypatch.setattr(checkpoints.Weights, "read", lambda *args: pytest.fail("a tensor read"))
    assert ckpt.dtype(a) == torch.float32
    monkeypatch.undo()
    allocated, empty_like = [], torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, **kw: allocated.append(t.nbytes) or empty_like(t, **kw))
    model = models.from_config(ckpt.config, keys=ckpt.weights.keys())
    # every parameter and buffer once (the buffers' RoPE tables are made again in float32 after)
    assert sum(allocated) == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert (model.lm_head.weight is model.embed.weight) == a.tie_embeddings


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "15.70 GiB of which 1.10 GiB is free.\nMore text")
OUT_OF_MEMORY = {  # how running out of memory reaches the commands: the message's first line
    "allocator": (lambda: torch.OutOfMemoryError(CUDA_OOM),
                  "CUDA out of memory. Tried to allocate"),
    # torch.compile wraps what its backend raised
    "compiling": (lambda: BackendCompilerFailed(None, torch.OutOfMemoryError(CUDA_OOM), None),
                  "CUDA out of memory. Tried to allocate"),
    "inductor": (lambda: InductorError(torch.OutOfMemoryError(CUDA_OOM), None),
                 "CUDA out of memory. Tried to allocate"),
    "a kernel": (lambda: torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors "
                                                "might be asynchronously reported"),
                 "CUDA error: out of memory"),
    "cuBLAS": (lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                    "`cublasCreate(handle)`"), "CUDA error: CUBLAS_STATUS_ALLOC"),
    "a cause": (lambda: chained(RuntimeError("the call failed"), torch.OutOfMemoryError(CUDA_OOM)),
                "CUDA out of memory. Tried to allocate"),
}


def chained(err, cause):
    err.__cause__ = cause
    return err


@pytest.mark.parametrize("form", OUT_OF_MEMORY)
@pytest.mark.parametrize("script", [run, bench])
def test_running_out_of_memory_while_decoding_is_one_line(script, form, monkeypatch, capsys):
    make, first = OUT_OF_MEMORY[form]

    def oom(*args, **kw):
        raise make()
    monkeypatch.setattr(model_runner.Decoder, "advance", oom)
    argv = ["--model", OURO_A, "--max-new-tokens", "4"] + (
        ["--prompt-ids", "1,2"] if script is run else ["--num-prompts", "1", "--out", ""])
    with pytest.raises(SystemExit) as exit:
        script.main(argv)
    line = capsys.readouterr().err.splitlines()[-1]
    assert (exit.value.code == 2 and line.startswith("error: out of memory: " + first)
            and "try a smaller --batch-size" in line), line


def test_other_runtime_errors_keep_their_traceback(monkeypatch):
    """A RuntimeError that is not memory running out is a bug: it is not turned into one line."""
    def bug(*args, **kw):
        raise BackendCompilerFailed(None, RuntimeError("shape mismatch"), None)
    monkeypatch.setattr(model_runner.Decoder, "advance", bug)
    with pytest.raises(BackendCompilerFailed):
        run.main(["--model", OURO_A, "--max-new-tokens", "4", "--prompt-ids", "1,2"])


def test_stdlib_prompts_start_with_parcaes_bos():
    model = models.load(os.path.join(HERE, "testdata", "parcae_A"))
    with pytest.raises(ValueError, match="this model has no tokenizer.json: use --num-prompts"):
        bench.stdlib_prompts(model, 1)  # bench.py itself takes random ids for such a model
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
    tokens = engine.generate(model, [1, 2, 3], 12, method="ar").tokens
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
    steps = (tmp_path / "results" / "steps.txt").read_text().splitlines()
    assert [re.fullmatch(r"(\w+): exit 0 in \d+ s", s)[1] for s in steps] == ["huginn", "ouro"]


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
    answers kept; --resume (run in this process) measures the rest, and refuses other flags. Twelve
    prompts, so that the process is still running when the signal comes, on a busy machine too."""
    n = 12
    args = lambda *extra: bench_args(tmp_path, "--num-prompts", str(n), *extra)
    wfd_file = tmp_path / "ouro_A-wfd.jsonl"
    status, err = interrupt([sys.executable, os.path.join(ROOT, "bench.py")] + args(),
                            lambda: wfd_file.exists() and wfd_file.stat().st_size)
    assert status == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("interrupted: the finished answers are in ")
    lines = {m: (tmp_path / f"ouro_A-{m}.jsonl").read_text().splitlines()
             for m in ("ar", "ar-wave", "wfd")}
    finished = len(lines["wfd"])
    assert 1 <= finished < n and all(len(v) >= finished for v in lines.values())
    bench.main(args("--resume"))
    out = capsys.readouterr().out
    assert f"### overall ({n} prompts, {finished} of them resumed from " in out
    for m in ("ar", "ar-wave", "wfd"):
        ids = [json.loads(line)["question_id"] for line in (tmp_path / f"ouro_A-{m}.jsonl").open()]
        assert sorted(ids) == list(range(n)), m
    assert "| WFD | 4 |" in out and "| 100% |" in out
    with pytest.raises(SystemExit) as exit:
        bench.main(args("--resume", "--max-new-tokens", "21"))
    assert exit.value.code == 2 and "holds answers of another run" in capsys.readouterr().err


def answers_in(folder, names=("ar", "ar-wave", "wfd")):
    """Each method's answers in folder: question id -> the tokens (each id occurs once)."""
    out = {}
    for n in names:
        ids = [json.loads(line) for line in (folder / f"ouro_A-{n}.jsonl").open()]
        assert len({a["question_id"] for a in ids}) == len(ids), n
        out[n] = {a["question_id"]: a["bench"]["tokens"] for a in ids}
    return out


def cut_and_resume(capsys, whole, folder, name, cut, extra=()):
    """A copy of the finished answers in `whole` with `name`'s file cut to its first `cut` bytes
    (a kill while it was written), resumed: (the answers after it, stderr)."""
    shutil.copytree(whole, folder)
    path = folder / f"ouro_A-{name}.jsonl"
    path.write_bytes(path.read_bytes()[:cut])
    bench.main(bench_args(folder, "--resume", *extra))
    return answers_in(folder), capsys.readouterr().err


@pytest.mark.parametrize("offsets", [pytest.param(range(1, 101), marks=slow), (1, 2, 40, 99, 100)],
                         ids=["every", "some"])
def test_a_cut_last_line_is_dropped_and_measured_again(tmp_path, capsys, offsets):
    """A hard kill (SIGKILL, the OOM killer, a power cut) may cut the last line of an answer file
    anywhere: --resume drops it, says so in one line naming the file and line, and measures its
    prompt again; every question is answered once, with the tokens of a run never cut short. Any
    other damaged line is refused in one line, status 2."""
    whole = tmp_path / "whole"
    bench.main(bench_args(whole))
    want = answers_in(whole)
    names = ("ar", "ar-wave", "wfd")
    for off in offsets:
        name = names[off % 3]
        size = (whole / f"ouro_A-{name}.jsonl").stat().st_size
        got, err = cut_and_resume(capsys, whole, tmp_path / f"cut{off}", name, size - off)
        assert got == want, off
        last = len((whole / f"ouro_A-{name}.jsonl").read_text().splitlines())
        if off == 1:  # the newline alone: the line is whole, and kept
            assert "cut short" not in err
        else:
            assert (f"ouro_A-{name}.jsonl line {last}: cut short (the run was killed while writing "
                    "it); dropped, its prompt is measured again") in err, (off, err)
    damaged = tmp_path / "damaged"
    shutil.copytree(whole, damaged)
    path = damaged / "ouro_A-wfd.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0][:30] + "\n" + "".join(lines[1:]))
    with pytest.raises(SystemExit) as exit:
        bench.main(bench_args(damaged, "--resume"))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err, err
    assert "ouro_A-wfd.jsonl line 1 is not an answer of bench.py" in err.splitlines()[-1]
    # a blank line is skipped, and a method whose file is gone has answered nothing: no prompt
    # is answered by every method, so each is measured again
    gaps = tmp_path / "gaps"
    shutil.copytree(whole, gaps)
    path = gaps / "ouro_A-ar.jsonl"
    path.write_text(path.read_text().replace("\n", "\n\n", 1))
    (gaps / "ouro_A-wfd.jsonl").unlink()
    bench.main(bench_args(gaps, "--resume"))
    assert answers_in(gaps) == want


def test_a_batched_run_resumes_with_fewer_prompts_left_than_slots(tmp_path, capsys):
    """--batch-size 4 --resume after an interrupt that left 1, 2 or 3 of 4 prompts unanswered: the
    batch shrinks to the prompts left (the run's identity keeps --batch-size 4), the header says
    so, and the answers are complete, each the tokens of the run never interrupted."""
    batch = ["--num-prompts", "4", "--batch-size", "4"]
    whole = tmp_path / "whole"
    bench.main(bench_args(whole, *batch))
    want = answers_in(whole)
    capsys.readouterr()
    for left in (1, 2, 3):
        folder = tmp_path / f"left{left}"
        shutil.copytree(whole, folder)
        for n in want:  # answers are appended as their prompts finish: the first ones are kept
            path = folder / f"ouro_A-{n}.jsonl"
            path.write_text("".join(path.read_text().splitlines(keepends=True)[:4 - left]))
        bench.main(bench_args(folder, "--resume", *batch))
        out = capsys.readouterr().out
        assert answers_in(folder) == want, left
        assert f"### overall (4 prompts, {4 - left} of them resumed from " in out
        assert (f"batch 4 (slots refilled as sequences finish); the prompts left after resuming "
                f"ran through {left} slots") in out, out


def test_an_interrupted_run_py_is_one_line_and_status_130():
    # float64 on one thread: about 2.5 s of decoding left when the signal is sent
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), "--prompt", "def f(x):",
           "--max-new-tokens", "200", "--dtype", "float64", "--threads", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stdout.read(9) == b"def f(x):"  # streaming has begun
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.decode() == "interrupted\n"
