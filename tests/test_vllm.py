"""The vLLM plugin (serving/vllm, docs/serving.md): vLLM's greedy tokens are the project's AR
tokens, with and without self-speculation, and its logprobs are close to the project's logits.

They run where vLLM's CPU build is installed (requirements-vllm.txt, `pip install -e
serving/vllm`; .ci/run makes such an environment), one engine at a time, in this process."""
import gc
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -r requirements-vllm.txt; "
                    "pip install -e serving/vllm: docs/serving.md)")
pytest.importorskip("wfd_vllm", reason="the plugin is not installed (pip install -e serving/vllm)")
# vLLM's CPU build on a small machine: one OpenMP thread, unbound; 1 GiB of KV; the engine in
# this process (set before vLLM reads them, for this process and the servers it starts)
os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.parallel_state import (destroy_distributed_environment,  # noqa: E402
                                             destroy_model_parallel)

import models  # noqa: E402
import engine as project  # noqa: E402  (the project's engine)
from demo import train as train_demo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")
SERVING_DOC = os.path.join(ROOT, "docs", "serving.md")
NEW_TOKENS = 24


def speculation(folder, n):
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": n}


@contextmanager
def engine(folder, n=None, k=None, **settings):
    """A vLLM engine of the checkpoint in this process, float32, eager; with n, self-speculation of
    n tokens drafted at depth k (the config's wfd_draft_steps where k is None)."""
    settings = {"seed": 0, **settings}
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=256,
              speculative_config=n and speculation(folder, n),
              hf_overrides=None if k is None else {"wfd_draft_steps": k}, **settings)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()


def greedy(llm, prompts, n=NEW_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def check_equals_ar(model, prompts, outputs):
    """Each output's tokens are AR's, and each token's logprob is the log-softmax of the logits
    that chose it in the project's AR (float32: to 1e-3)."""
    for prompt, out in zip(prompts, outputs):
        ref = project.generate(model, prompt, len(out.token_ids), method="ar", keep_logits=True)
        assert list(out.token_ids) == ref.tokens
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        theirs = torch.stack([torch.log_softmax(logits, -1)[t]
                              for logits, t in zip(ref.logits, ref.tokens)])
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)


def project_drafts(model, prompt, n, k):
    """The project's WFD at draft depth k: its tokens, and for each new token's index i, the token
    its depth-k read drafted there from the committed tokens before i (the last draft_hook call
    for the position: a draft read from a rejected row is always followed by the restarted
    row's)."""
    drafts = {}

    def hook(pos, token):
        drafts[pos - len(prompt)] = token
        return token

    ref = project.generate(model, prompt, n, method="wfd", draft_steps=k, draft_hook=hook)
    return ref.tokens, drafts


def check_drafts(llm, model, prompts, k):
    """vLLM's draft proposals are the project's depth-k reads: each proposal made from committed
    tokens only (the first of a round, and those after drafts that were right) equals the
    project's draft at that index. One prompt per call, so a proposal's row is the prompt's; a
    round's context is tracked as vLLM's greedy verification commits (the drafts up to the first
    wrong one, then the target's token)."""
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    rounds, propose = [], drafter.propose

    def recorded(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        rounds.append((int(kwargs["next_token_ids"][0]), drafts[0].tolist()))
        return drafts

    drafter.propose, compared = recorded, 0
    try:
        for prompt in prompts:
            rounds.clear()
            out = list(greedy(llm, [prompt])[0].token_ids)
            tokens, theirs = project_drafts(model, prompt, len(out), k)
            assert tokens == out
            committed = 1  # the prefill's token
            for last, drafts in rounds:
                if committed > len(out):
                    break  # the round after the last token
                assert last == out[committed - 1]  # the context is tracked right
                right = 0
                while right < len(drafts) and committed + right < len(out):
                    i = committed + right
                    if i in theirs:
                        assert drafts[right] == theirs[i], (i, drafts, theirs[i])
                        compared += 1
                    if drafts[right] != out[i]:
                        break
                    right += 1
                committed += right + 1
    finally:
        del drafter.propose
    assert compared >= len(prompts) * NEW_TOKENS // 2  # most new tokens checked


@pytest.fixture(scope="module")
def demo():
    return models.load(DEMO)


@pytest.fixture(scope="module")
def prompts(demo):
    return train_demo.eval_prompts(demo.tokenizer, count=3)


TINY = {  # random-weight configs in the hub format, head_dim 32 (the CPU attention's smallest)
    "ouro": {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 64,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
             "intermediate_size": 96, "vocab_size": 2048, "num_hidden_layers": 2,
             "total_ut_steps": 4, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": 0,
             "torch_dtype": "float32"},
    "huginn": {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_embd": 64,
               "n_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
               "vocab_size": 2048, "padded_vocab_size": 2048, "n_layers": 4,
               "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2,
               "n_layers_in_coda": 1, "mean_recurrence": 4, "block_size": 256,
               "rope_base": 50000.0, "norm_eps": 1e-6, "qk_bias": True, "tie_embeddings": True,
               "injection_type": "linear", "init_values": {"std": 0.08, "embed_scale": 8.0},
               "eos_token_id": 0, "torch_dtype": "float32"},
}
# the Raven retrofits: huginn_raven configs, their blocks told apart by the checkpoint's tensors
RETROFIT = dict(TINY["huginn"], num_key_value_heads=1, qk_bias=False, tie_embeddings=False,
                rope_theta=10000.0, max_position_embeddings=256,
                init_values={"std": 0.08, "embed_scale": 1.0})
TINY["llama"] = dict(RETROFIT, wfd_layout="llama", rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=16))
TINY["olmo2"] = dict(RETROFIT, wfd_layout="olmo2")
TINY["loopformer"] = {"architectures": ["LoopFormerGPTForCausalLM"], "model_type": "loopformer",
                      "block_size": 256, "vocab_size": 2048, "n_layer": 2, "n_head": 2,
                      "n_embd": 64, "bias": False, "intermediate_dim": 96, "max_model_loops": 4,
                      "torch_dtype": "float32"}

# Parcae's config.json: a dump of its config class (no model_type), read by the path's "parcae"
TINY["parcae"] = {"_class_name": "ParcaeConfig", "model_class_name": "Parcae", "n_embd": 64,
                  "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 96,
                  "recurrent_intermediation_embedding_dimension": 128, "vocab_size": 2048,
                  "padded_vocab_size": 2048, "block_size": 256, "n_layers_in_prelude": 1,
                  "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1, "mean_recurrence": 4,
                  "mean_backprop_depth": 2, "injection_type": "diagonal", "qk_norm": True,
                  "prelude_norm": True, "tie_embeddings": True, "norm_eps": 1e-5,
                  "rope_settings": {"use_rope": True, "rope_base": 50000},
                  "state_init": "like-init"}


def tiny(folder, family="ouro", **config):
    """A random-weight checkpoint of the family in the hub format, with the demo's tokenizer."""
    model = models.from_config({**TINY[family], **config}, init_seed=1)
    models.save(model, folder)
    shutil.copy(os.path.join(DEMO, "tokenizer.json"), folder)
    return models.load(folder)


def test_demo_greedy_equals_ar(demo, prompts):
    with engine(DEMO) as llm:
        check_equals_ar(demo, prompts, greedy(llm, prompts))


@pytest.mark.parametrize("k,n", [(1, 2), (2, 3), (1, 4)])
def test_demo_self_speculation_equals_ar(demo, prompts, k, n):
    with engine(DEMO, n, k) as llm:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        draft = runner.drafter.model
        assert draft.depth == k and not list(draft.parameters())  # the target's weights
        # and the target's KV: each draft layer (the demo's, depth d < k) on the target's of the
        # same depth, so vLLM gives the draft none
        layers = range(k * demo.args.n_core)
        assert runner.shared_kv_cache_layers == {
            f"draft_model.layers.{i}.attn": f"layers.{i}.attn" for i in layers}
        check_equals_ar(demo, prompts, greedy(llm, prompts))
        check_drafts(llm, demo, prompts, k)


@pytest.mark.parametrize("family", TINY)
def test_tiny_random_family_equals_ar(tmp_path, family):
    """Self-speculating (n = 3, k = 2); Parcae without too (test_tensor_parallel_2_equals_ar).
    The draft's prelude and core layers are on the target's KV, its coda's on its own."""
    model = tiny(tmp_path, family)
    prompts = [[5, 17, 300, 9], list(range(40, 70))]
    with engine(tmp_path, 3, 2) as llm:
        check_equals_ar(model, prompts, greedy(llm, prompts))
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    a = model.args
    assert runner.shared_kv_cache_layers == {f"draft_model.layers.{i}.attn": f"layers.{i}.attn"
                                             for i in range(a.n_prelude + 2 * a.n_core)}


def start_up_error(folder, **settings):
    """The message of the error an engine of `folder` stops with at start-up."""
    with pytest.raises(Exception) as err:
        with engine(folder, **settings):
            pass
    return str(err.value)


def test_draft_depth_is_an_int_below_T():
    """wfd_draft_steps: absent, the default max(1, T // 8); an int in 1..T-1, itself; anything else
    (0, T, a bool, a float, a string) refused by the docstring's message."""
    from types import SimpleNamespace

    from wfd_vllm.model import draft_depth

    def depth(T, **config):
        target = SimpleNamespace(hf_config=SimpleNamespace(**config))
        return draft_depth(SimpleNamespace(speculative_config=SimpleNamespace(
            target_model_config=target)), T)

    assert (depth(4), depth(32), depth(4, wfd_draft_steps=3)) == (1, 4, 3)
    for k in (0, -1, 4, 5, True, False, 2.0, "2"):
        with pytest.raises(ValueError, match=f"wfd_draft_steps={k!r} must be an integer in 1..3 "
                           r"\(the full depth T is 4\)"):
            depth(4, wfd_draft_steps=k)


def test_draft_reads_the_weights_it_does_not_load():
    """The draft loads none of the checkpoint's tensors, but reads vLLM's iterator to its end (vLLM
    times the load from its first tensor)."""
    from types import SimpleNamespace

    from wfd_vllm.model import LoopedForCausalLM

    tensors = iter([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    assert LoopedForCausalLM.load_weights(SimpleNamespace(is_draft=True), tensors) == set()
    assert next(tensors, None) is None


def test_initial_state_follows_the_engine_seed(tmp_path):
    """Huginn's initial state is drawn from the engine's seed, as the project's from its seed: an
    engine of seed 5 gives the AR of models.load(seed=5), whose logits are not seed 0's."""
    tiny(tmp_path, "huginn")
    model = models.load(tmp_path, seed=5)
    prompts = [[5, 17, 300, 9]]
    with engine(tmp_path, seed=5) as llm:
        outputs = greedy(llm, prompts)
    check_equals_ar(model, prompts, outputs)
    seed0 = project.generate(models.load(tmp_path), prompts[0], 4, method="ar", keep_logits=True)
    seed5 = project.generate(model, prompts[0], 4, method="ar", keep_logits=True)
    assert not torch.allclose(seed0.logits[0], seed5.logits[0], atol=1e-3)


def test_bad_input_is_refused_at_start_up(tmp_path):
    assert "wfd_draft_steps=4 must be an integer in 1..3" in start_up_error(DEMO, n=2, k=4)
    assert "wfd_draft_steps=0 must be an integer in 1..3" in start_up_error(DEMO, n=2, k=0)
    tiny(tmp_path / "loopformer", "loopformer")
    # vLLM's dummy weights skip load_weights (and a CPU engine runs no forward at start-up)
    with engine(tmp_path / "loopformer", load_format="dummy") as llm:
        with pytest.raises(Exception) as err:
            greedy(llm, [[5, 17]], 1)
    assert "LoopFormer's clock table is not made" in repr(err.value) + str(err.value.__cause__)
    tiny(tmp_path / "hd16", hidden_size=32, head_dim=16)
    assert "head_dim 16 is not served" in start_up_error(tmp_path / "hd16")
    folder = tmp_path / "unknown"
    shutil.copytree(DEMO, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["NopeForCausalLM"])))
    assert "NopeForCausalLM" in start_up_error(folder)
    folder = tmp_path / "missing"
    tiny(folder)
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    assert "lacks tensor 'model.layers.1.mlp.down_proj.weight'" in start_up_error(folder)


def doc_blocks(language):
    """docs/serving.md's code blocks in `language` ("" for plain ones), in order."""
    blocks, block, fence = [], None, None
    for line in open(SERVING_DOC):
        if block is None and line.startswith("```"):
            block, fence = [], line[3:].strip()
        elif block is not None and line.rstrip() == "```":
            blocks += ["".join(block)] if fence == language else []
            block = None
        elif block is not None:
            block.append(line)
    return blocks


def test_docs_example_runs_as_written(demo, tmp_path):
    """docs/serving.md's Python example, run as its page says (a script, from the repository's
    root, vLLM's engine in a process of its own): it prints AR's text of its prompt."""
    script = tmp_path / "example.py"
    script.write_text(doc_blocks("python")[0])
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ar_text(demo, demo.tokenizer.encode("def fibonacci(n):").ids, 32) in run.stdout


def ar_text(model, prompt, n):
    """The text of the project's AR tokens, up to a stop token (which vLLM ends on, unprinted)."""
    tokens = project.generate(model, prompt, n, method="ar").tokens
    stop = [i for i, t in enumerate(tokens) if t in model.eos_token_ids]
    return model.tokenizer.decode(tokens[:stop[0]] if stop else tokens)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    """An OpenAI-compatible request; the answer's JSON, or the streamed chunks' JSON."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        if not body.get("stream"):
            return json.load(response)
        lines = [line.decode().strip() for line in response]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_served_completion_and_chat_equal_ar(demo, tmp_path):
    """vLLM's OpenAI-compatible server of demo/ with self-speculation (k = 2, n = 3) on 127.0.0.1:
    a completion, a chat and a streamed chat request, each answer's tokens AR's of the prompt
    tokens the server made; then docs/serving.md's client, its texts AR's. The server is started
    as that page starts it (from the repository's root, its chat template). (It is `vllm
    serve`'s server; vllm-cpu 0.32.0's `vllm` command stops at the version of a package named
    vllm, which it is not.)"""
    template = tmp_path / "chat.jinja"  # docs/serving.md's
    template.write_text(re.search(r"<<'EOF'\n(.*?)^EOF$", doc_blocks("")[1], re.S | re.M)[1])
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "demo",
         "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
         "--speculative-config", json.dumps(speculation("demo", 3)), "--chat-template",
         str(template)], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to 2 minutes on a busy machine
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        settings = dict(model="demo", max_tokens=16, temperature=0, ignore_eos=True,
                        return_token_ids=True)
        done = post(url + "/v1/completions", dict(settings, prompt="def fibonacci(n):"))
        answers = [(done["choices"][0]["prompt_token_ids"], done["choices"][0]["token_ids"])]
        chat = dict(settings, messages=[{"role": "user", "content": "def add(a, b):"}])
        done = post(url + "/v1/chat/completions", chat)
        answers.append((done["prompt_token_ids"], done["choices"][0]["token_ids"]))
        chunks = post(url + "/v1/chat/completions", dict(chat, stream=True))
        answers.append((chunks[0]["prompt_token_ids"],
                        [t for c in chunks for choice in c["choices"]
                         for t in choice.get("token_ids") or []]))
        assert answers[1] == answers[2]
        for prompt, tokens in answers:
            assert tokens == project.generate(demo, prompt, 16, method="ar").tokens
        # docs/serving.md's client, as written but for the port: AR's texts of the same prompts
        client = doc_blocks("python")[1].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        run = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        for prompt, _ in answers[:2]:
            assert ar_text(demo, prompt, 32) in run.stdout
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.parametrize("family,n", [("olmo2", 3), ("parcae", None)])
def test_tensor_parallel_2_equals_ar(prompts, tmp_path, family, n):
    """Two ranks (worker processes): each rank with half the q heads, the MLP and the vocabulary;
    an OLMo-2 retrofit self-speculating, its one kv head on both ranks, its q and k norms over
    both ranks' heads; Parcae without self-speculation, its value tables' columns and gates' rows
    by kv head, one on each rank."""
    model = tiny(tmp_path, family)
    k = 2 if n else None
    with engine(tmp_path, n, k, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outputs = greedy(llm, prompts)
    check_equals_ar(model, prompts, outputs)
