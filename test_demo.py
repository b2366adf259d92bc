"""Tests of the demo model (demo/, trained by train_demo.py on the Python standard library)."""
import os
import subprocess
import sys

import pytest

import models
import train_demo
import wfd

HERE = os.path.dirname(os.path.abspath(__file__))


def test_smoke_training_writes_a_loadable_checkpoint(tmp_path):
    subprocess.run([sys.executable, os.path.join(HERE, "train_demo.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    model = models.load(str(tmp_path))
    prompt = model.tokenizer.encode("def f(x):\n    return").ids
    ar = wfd.generate(model, prompt, 8, method="ar")
    assert wfd.generate(model, prompt, 8, method="wfd").tokens == ar.tokens


@pytest.fixture(scope="module")
def demo():
    return models.load(os.path.join(HERE, "demo"))


def test_demo_is_an_ouro_checkpoint_with_its_tokenizer(demo):
    assert demo.kind == "ouro" and demo.tokenizer.get_vocab_size() == demo.args.vocab_size
    text = "def f(x):\n    return x + 1\n"
    assert demo.tokenizer.decode(demo.tokenizer.encode(text).ids) == text


@pytest.mark.parametrize("k", [1, 2, 3])
def test_demo_wfd_and_dtv_equal_ar_on_a_held_out_prompt(demo, k):
    prompt = train_demo.eval_prompts(demo.tokenizer, count=1)[0]
    ar = wfd.generate(demo, prompt, 40, method="ar")
    assert wfd.generate(demo, prompt, 40, method="wfd", draft_steps=k).tokens == ar.tokens
    assert wfd.generate(demo, prompt, 40, method="dtv", draft_steps=k).tokens == ar.tokens
