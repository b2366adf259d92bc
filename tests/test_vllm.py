"""The vLLM plugin (serving/vllm, docs/serving.md): vLLM's greedy tokens are the project's AR tokens,
with and without self-speculation, and its logprobs are close to the project's logits.

They run where vLLM's CPU build is installed (requirements-vllm.txt, `pip install -e
serving/vllm`; .ci/run makes such an environment), one engine at a time, in this process."""
import gc
import json
import os
import shutil
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
import wfd  # noqa: E402
from demo import train as train_demo  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
NEW_TOKENS = 24


def speculation(folder, n):
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": n}


@contextmanager
def engine(folder, n=None, k=None, **settings):
    """A vLLM engine of the checkpoint in this process, float32, eager; with n, self-speculation of
    n tokens drafted at depth k (the config's wfd_draft_steps where k is None)."""
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              speculative_config=n and speculation(folder, n),
              hf_overrides={"wfd_draft_steps": k} if k else None, **settings)
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
        ref = wfd.generate(model, prompt, len(out.token_ids), method="ar", keep_logits=True)
        assert list(out.token_ids) == ref.tokens
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        theirs = torch.stack([torch.log_softmax(logits, -1)[t]
                              for logits, t in zip(ref.logits, ref.tokens)])
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def demo():
    return models.load(DEMO)


@pytest.fixture(scope="module")
def prompts(demo):
    return train_demo.eval_prompts(demo.tokenizer, count=3)


def tiny_ouro(folder, **config):
    """A random-weight Ouro checkpoint in the hub format, head_dim 32 (the CPU attention backend's
    smallest), grouped-query attention, with the demo's tokenizer."""
    config = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "intermediate_size": 96, "vocab_size": 2048, "num_hidden_layers": 2,
              "total_ut_steps": 4, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 0,
              "torch_dtype": "float32", **config}
    model = models.from_config(config, init_seed=1)
    models.save(model, folder)
    shutil.copy(os.path.join(DEMO, "tokenizer.json"), folder)
    return models.load(folder)


def test_demo_greedy_equals_ar(demo, prompts):
    with engine(DEMO) as llm:
        check_equals_ar(demo, prompts, greedy(llm, prompts))


@pytest.mark.parametrize("k,n", [(1, 2), (2, 3), (1, 4)])
def test_demo_self_speculation_equals_ar(demo, prompts, k, n):
    with engine(DEMO, n, k) as llm:
        drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
        draft = drafter.model
        assert draft.depth == k and not list(draft.parameters())  # the target's weights
        check_equals_ar(demo, prompts, greedy(llm, prompts))


def test_tiny_random_ouro_equals_ar(tmp_path):
    model = tiny_ouro(tmp_path, tie_word_embeddings=True)
    prompts = [[5, 17, 300, 9], list(range(40, 70))]
    with engine(tmp_path, 3, 2) as llm:
        check_equals_ar(model, prompts, greedy(llm, prompts))
