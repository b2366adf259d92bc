"""What a real checkpoint brings beside its weights, on the tiny goldens given the same kind of
files as the hub's (written here into temporary folders): stop ids from generation_config.json, a
chat template in tokenizer_config.json, a tokenizer with the special tokens. And the memory a load
and a generation take."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers import models as tokenizer_models

import bench
import engine
import models
import run
from engine import kv_cache
from formats import chat, devices

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the project
CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!:'\n"
# the special tokens where the real vocabularies have them: Ouro's first, Huginn's at the top
SPECIAL = {"ouro": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
           "huginn": {"<|begin_text|>": 120, "<|end_text|>": 121, "<|begin_header|>": 122,
                      "<|end_header|>": 123, "<|end_turn|>": 124, "<|pad|>": 125}}
# templates of the hub's kinds, written here: ChatML over several lines, which rejects a role it
# does not know, and Huginn's, with its {% generation %} block and the BOS token before the first
# message
CHATML = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""  # clean only with trim_blocks and lstrip_blocks, as apply_chat_template renders
HUGINN = ("{% for message in messages %}{% set start = '<|begin_header|>' %}"
          "{% if loop.index0 == 0 %}{% set start = bos_token + start %}{% endif %}"
          "{% if message['role'] == 'assistant' %}{{ start + 'Huginn<|end_header|>\\n\\n' }}"
          "{% generation %}{{ message['content'] | trim + '<|end_turn|>' }}{% endgeneration %}"
          "{% else %}{{ start + message['role'] + '<|end_header|>\\n\\n'"
          " + message['content'] | trim + '<|end_turn|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}"
          "{% else %}{{ '<|end_text|>' }}{% endif %}")
GOLDEN = {"ouro": "ouro_A", "huginn": "huginn_A"}


def tokenizer(kind):
    """One token per character, and the family's special tokens at their ids."""
    vocab = {c: i for i, c in enumerate(CHARS, start=8)} | {"<unk>": 7} | SPECIAL[kind]
    tok = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL[kind]))
    return tok


def checkpoint(tmp_path, kind, generation=None, tokenizer_config=None, name="model"):
    """A golden checkpoint (config.json as the goldens have it: Ouro's eos 2, Huginn's none) with a
    tokenizer and, when given, generation_config.json and tokenizer_config.json."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(HERE, "testdata", GOLDEN[kind], file), folder / file)
    tokenizer(kind).save(str(folder / "tokenizer.json"))
    for file, content in (("generation_config.json", generation),
                          ("tokenizer_config.json", tokenizer_config)):
        if content is not None:
            (folder / file).write_text(json.dumps(content))
    return str(folder)


def run_json(capsys, argv):
    run.main(argv + ["--json"])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_load_gathers_the_stop_ids(tmp_path):
    # config.json's
    assert models.load(checkpoint(tmp_path, "ouro", name="a")).eos_token_ids == (2,)
    assert models.load(checkpoint(tmp_path, "huginn", name="b")).eos_token_ids == ()
    # generation_config.json's win, an int or a list (as the hub's huginn-0125 has: end of text and
    # of turn)
    assert models.load(checkpoint(tmp_path, "ouro", {"eos_token_id": 0},
                                  name="c")).eos_token_ids == (0,)
    assert models.load(checkpoint(tmp_path, "huginn",
                                  {"bos_token_id": 120, "eos_token_id": [121, 124]},
                                  name="d")).eos_token_ids == (121, 124)
    assert models.load(checkpoint(tmp_path, "ouro", {"temperature": 0.7},
                                  name="e")).eos_token_ids == (2,)
    folder = checkpoint(tmp_path, "ouro", {"eos_token_id": ["2"]}, name="f")
    with pytest.raises(ValueError,
                       match=r"generation_config\.json: eos_token_id must be a token id or a list"):
        models.load(folder)


@pytest.mark.parametrize("kind", ["ouro", "huginn"])
def test_run_py_stops_at_a_generation_config_list(kind, tmp_path, capsys):
    plain = checkpoint(tmp_path, kind, name="plain")
    ref = run_json(capsys, ["--model", plain, "--prompt-ids", "5,6,7", "--max-new-tokens", "24",
                            "--method", "ar", "--eos", ""])[0]["tokens"]
    assert len(ref) == 24
    absent = next(t for t in range(128) if t not in ref)
    stop = [absent, ref[9], ref[5]]  # the first of them in AR's tokens ends it
    first = min(i for i, t in enumerate(ref) if t in stop)
    folder = checkpoint(tmp_path, kind, {"eos_token_id": stop})
    for out in run_json(capsys, ["--model", folder, "--prompt-ids", "5,6,7",
                                 "--max-new-tokens", "24", "--method", "all"]):
        assert out["tokens"] == ref[:first + 1], out["method"]
        assert (out["stats"]["stop_token"] == ref[first]
                and out["stats"]["eos_token_ids"] == sorted(stop))
    # --eos overrides them; a run to the limit names no stop token
    out = run_json(capsys, ["--model", folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "24",
                            "--eos", str(absent)])
    assert out[0]["tokens"] == ref and out[0]["stats"]["stop_token"] is None


def test_run_py_chat_renders_the_checkpoints_chatml_template(tmp_path, capsys):
    config = {"chat_template": CHATML, "bos_token": "<|im_start|>",
              "eos_token": {"content": "<|im_end|>", "special": True}}
    folder = checkpoint(tmp_path, "ouro", {"eos_token_id": 0}, config)
    out = run_json(capsys, ["--model", folder, "--chat", "--prompt", "Hi there",
                            "--max-new-tokens", "3"])[0]
    # the template, rendered by hand
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_ids"] == tokenizer("ouro").encode(text, add_special_tokens=False).ids
    assert out["prompt_ids"][0] == SPECIAL["ouro"]["<|im_start|>"]
    # generation_config.json's, and the end of the turn
    assert out["stats"]["eos_token_ids"] == [0, 2]
    plain = run_json(capsys, ["--model", folder, "--prompt", "Hi there",
                              "--max-new-tokens", "3"])[0]
    assert (plain["prompt_ids"] == tokenizer("ouro").encode("Hi there").ids
            and plain["stats"]["eos_token_ids"] == [0])


def test_huginns_template_with_its_generation_block(tmp_path):
    config = {"chat_template": HUGINN, "bos_token": "<|begin_text|>", "eos_token": "<|end_text|>"}
    model = models.load(checkpoint(tmp_path, "huginn", {"eos_token_id": [121]}, config))
    messages = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Yes."}]
    assert chat.render(model, messages, add_generation_prompt=False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\nYes.<|end_turn|><|end_text|>")
    ids, stop = chat.chat_prompt(model, "Hi")
    assert tokenizer("huginn").decode(ids, skip_special_tokens=False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n")
    assert stop == (121, 124)


def test_the_globals_and_filters_of_apply_chat_template(tmp_path):
    text = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}"
            "{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
            "|{{ eos_token }}")
    model = models.load(checkpoint(tmp_path, "ouro", tokenizer_config={"chat_template": text,
                                                                       "eos_token": "<|im_end|>"}))
    messages = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}]
    assert chat.render(model, messages) == (
        '[{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}]|4|é|<|im_end|>')


def test_family_formats_where_the_checkpoint_has_no_template(tmp_path, capsys):
    ouro = models.load(checkpoint(tmp_path, "ouro", name="ouro"))
    ids, stop = chat.chat_prompt(ouro, "Hi?")
    assert tokenizer("ouro").decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert stop == (2,)  # config.json's eos is the end of the turn already
    huginn = models.load(checkpoint(tmp_path, "huginn", name="huginn"))
    ids, stop = chat.chat_prompt(huginn, " Hi? ")
    assert tokenizer("huginn").decode(ids, skip_special_tokens=False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi?<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n")
    assert stop == (124,)
    # the demo has neither a template nor ChatML's tokens: run.py --chat and bench.py
    # --prompt-format chat are refused
    for script, argv in ((run, ["--chat", "--prompt", "Hi?"]),
                         (bench, ["--questions", bench.QUESTIONS,
                                  "--prompt-format", "chat", "--out", ""])):
        with pytest.raises(SystemExit) as exit:
            script.main(argv)
        assert (exit.value.code == 2
                and "has no chat template" in capsys.readouterr().err.splitlines()[-1])


def test_bench_questions_take_the_checkpoints_template(tmp_path):
    model = models.load(checkpoint(tmp_path, "ouro", {"eos_token_id": 0},
                                   {"chat_template": CHATML}))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(dict(question_id=1, category="qa", turns=["Why?", "And?"]))
                         + "\n")
    [prompt] = bench.specbench_prompts(model, str(questions), None, None, as_chat=True)
    assert prompt["ids"] == tokenizer("ouro").encode(
        "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    assert prompt["eos"] == (0, 2)
    [prompt] = bench.specbench_prompts(model, str(questions), None, None, as_chat=False)
    assert prompt["ids"] == tokenizer("ouro").encode("Why?").ids and prompt["eos"] == (0,)


def test_template_errors_are_one_line(tmp_path, capsys):
    folder = checkpoint(tmp_path, "ouro",
                        tokenizer_config={"chat_template": CHATML.replace("'user', ", "")})
    with pytest.raises(SystemExit) as exit:
        run.main(["--model", folder, "--chat", "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert (exit.value.code == 2
            and err == "error: the chat template fails to render: unknown role user\n")
    with pytest.raises(SystemExit):
        run.main(["--model", folder, "--chat", "--prompt-ids", "1,2"])
    assert "--chat formats a --prompt text" in capsys.readouterr().err


class CountingTokenizer:
    """The demo's tokenizer, counting the tokens each decode is given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_streaming_decodes_the_tail_only(capsys):
    demo = models.load(run.DEMO)
    text = "def f(x):\n    return '中文 🙂' * x  # ok\n" * 12
    ids = demo.tokenizer.encode(text).ids
    assert len(ids) > 200
    tok = CountingTokenizer(demo.tokenizer)
    stream = run.TextStream(tok, ids[:3])
    for t in ids[3:]:
        stream.add(t)
    stream.show()
    assert capsys.readouterr().out == demo.tokenizer.decode(ids) + "\n"
    assert max(tok.lengths[2:]) <= 8  # the last piece and the tokens since: never the whole text


def test_kept_logits_are_copies_of_the_committed_rows():
    model = models.load(os.path.join(HERE, "testdata", "ouro_A"))
    out = engine.generate(model, [1, 2, 3], 6, keep_logits=True)
    V = model.args.vocab_size
    assert all(t.shape == (V,) and t.untyped_storage().nbytes() == V * 4 for t in out.logits)


def test_a_cache_that_does_not_fit_is_refused(monkeypatch, capsys):
    model = models.load(os.path.join(HERE, "testdata", "ouro_A"))
    for window in (None, 2):
        for capacity in (5, 60):
            assert (kv_cache.cache_bytes(model, capacity, 4, window)
                    == kv_cache.make_cache(model, capacity, 4, window).nbytes)
    free = kv_cache.cache_bytes(model, 40, 4) + 100  # room for 40 positions, not 41
    monkeypatch.setattr(devices, "free_memory", lambda device: free)
    # run.py's load: the KV cache is checked
    monkeypatch.setattr(devices, "check_weights_fit", lambda *args: None)
    need = kv_cache.cache_bytes(model, 3 + 60 - 1, 4)
    message = (f"the KV cache for 62 positions needs {need} bytes ({need / 2**30:.2f} GiB), "
               f"but cpu has {free} bytes "
               "free: at most 40 positions (prompt + max_new_tokens - 1) fit")
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate(model, [1, 2, 3], 60)
    assert len(engine.generate(model, [1, 2, 3], 38).tokens) == 38  # 40 positions
    with pytest.raises(SystemExit) as exit:
        run.main(["--model", os.path.join(HERE, "testdata", "ouro_A"), "--prompt-ids", "1,2,3",
                  "--max-new-tokens", "60"])
    err = capsys.readouterr().err
    assert (exit.value.code == 2 and err.startswith("error: the KV cache for 62 positions")
            and err.count("\n") == 1)


PEAK = """
import sys, torch, models
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
models.load(sys.argv[2], dtype=torch.bfloat16)  # torch's and safetensors' first-use costs, apart
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak, VmHWM
base = status("VmRSS")
models.load(sys.argv[1], dtype=torch.bfloat16)
print(status("VmHWM") - base)
"""


def test_a_bf16_load_of_a_float32_checkpoint_peaks_near_the_bf16_weights(tmp_path):
    with open(os.path.join(HERE, "testdata", "ouro_A", "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1024, num_hidden_layers=16, layer_types=["full_attention"] * 16,
                  vocab_size=2048)
    models.save(models.from_config(config, init_seed=0), tmp_path)
    size = os.path.getsize(tmp_path / "model.safetensors")  # 72 MB of float32
    # Linux gives a page only when it is written: MALLOC_PERTURB_ has malloc write every allocation,
    # so that the peak counts a float32 copy that is allocated and never filled
    # (on CUDA it would be real)
    env = dict(os.environ, MALLOC_PERTURB_="165", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path),
                           os.path.join(HERE, "testdata", "ouro_A")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout)
    # the bf16 weights are size / 2; a float32 model cast after, or the whole file read first, peaks
    # at size or more; what is left between is the allocator's own slack
    # (5-10 MB, machine-dependent)
    assert size / 2 <= peak <= 0.8 * size, (peak, size)
