"""Tests of the demo model (demo/, trained by train_demo.py on the Python standard library)."""
import os
import subprocess
import sys

import pytest
import torch

import models
import run
import wfd
from demo import train as train_demo
import engine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the project


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: a model this small, one thread


@pytest.mark.slow
def test_smoke_training_writes_a_loadable_checkpoint(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "demo", "train.py"), "--smoke",
                    "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    model = models.load(str(tmp_path))
    prompt = model.tokenizer.encode("def f(x):\n    return").ids
    ar = engine.generate(model, prompt, 8, method="ar")
    assert engine.generate(model, prompt, 8, method="wfd").tokens == ar.tokens


@pytest.fixture(scope="module")
def demo():
    return models.load(os.path.join(ROOT, "demo"))


def test_shared_kv_is_another_model_on_the_demo(demo):
    """README: on the demo, shared and full AR agree on the first token only (its run's prompt)."""
    prompt = demo.tokenizer.encode("def fibonacci(n):").ids
    full, shared = (wfd.generate(demo, prompt, 4, method="ar", kv=kv) for kv in ("full", "shared"))
    assert full.tokens[0] == shared.tokens[0] and full.tokens[1] != shared.tokens[1]


def test_demo_is_an_ouro_checkpoint_with_its_tokenizer(demo):
    assert demo.kind == "ouro" and demo.tokenizer.get_vocab_size() == demo.args.vocab_size
    text = "def f(x):\n    return x + 1\n"
    assert demo.tokenizer.decode(demo.tokenizer.encode(text).ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_demo_wfd_and_dtv_equal_ar_on_held_out_prompts(dtype):
    """Tokens and logits bit for bit against AR at the same width, at every draft depth."""
    model = models.load(os.path.join(ROOT, "demo"), dtype=dtype)
    for prompt in train_demo.eval_prompts(model.tokenizer, count=2):
        for k in (1, 2, 3):
            for method, width in (("wfd", None), ("dtv", 5)):
                out = engine.generate(model, prompt, 40, method=method, draft_steps=k,
                                      keep_logits=True)
                ar = engine.generate(model, prompt, 40, method="ar", draft_steps=k, width=width,
                                     keep_logits=True)
                assert out.tokens == ar.tokens, (method, k)
                assert torch.equal(torch.stack(out.logits), torch.stack(ar.logits)), (method, k)


def test_run_py_streams_the_demo_text(demo, capsys):
    """python run.py --prompt ...: the prompt, then the committed tokens as text, then the stats."""
    run.main(["--prompt", "def f(x):", "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    prompt = demo.tokenizer.encode("def f(x):").ids
    ar = engine.generate(demo, prompt, 12, method="ar", eos_token_id=demo.eos_token_ids)
    assert out.startswith(demo.tokenizer.decode(prompt + ar.tokens) + "\n[wfd] 12 tokens")


def test_run_py_method_all_and_the_wavefront_picture(capsys):
    run.main(["--prompt", "import os", "--max-new-tokens", "16", "--method", "all"])
    assert ("outputs identical to AR at the same width (tokens and logits): yes"
            in capsys.readouterr().out)
    run.main(["--prompt", "import os", "--max-new-tokens", "40", "--draft-steps", "1",
              "--show-wavefront"])
    picture = capsys.readouterr().out.split("[wfd] 40 tokens")[1]
    header, *rows = picture.splitlines()[1:8]
    # the first 24 R calls
    assert header.split()[:2] == ["R", "call"] and header.split()[-1] == "24"
    cells = " ".join(rows)
    assert "1d" in cells and "4=" in cells  # drafts read at depth k=1, tokens committed at T=4
    run.main(["--prompt", "import os", "--max-new-tokens", "12", "--draft-steps", "1",
              "--second-depth", "2", "--show-wavefront"])
    assert "  s  read again at the second depth m=2" in capsys.readouterr().out
