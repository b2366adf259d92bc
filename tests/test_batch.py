"""Tests of batched decoding: several prompts in slots, one wavefront each, refilled as they finish.
Each prompt's tokens and logits equal batched AR's at the same batch size and width, bit for bit, in
every dtype; in float64 they also equal the prompt's own single-prompt AR's tokens."""
import random

import pytest
import torch

import engine
from engine import kv_cache
from formats import devices
from test_engine import quick, same_logits, tiny_model

torch.set_num_threads(1)


def prompts_for(model, n, seed, longest=9):
    rng = random.Random(seed)
    return [[rng.randrange(model.args.vocab_size) for _ in range(rng.randint(1, longest))]
            for _ in range(n)]


def batched(model, prompts, n_new, **kw):
    return engine.generate(model, prompts, n_new, keep_logits=True, **kw)


def check_against_batched_ar(model, prompts, n_new, method, k, **kw):
    """The method's generations, each checked against batched AR's at the same batch size and
    width."""
    outs = batched(model, prompts, n_new, method=method, draft_steps=k, **kw)
    kw.pop("draft_hook", None)
    refs = batched(model, prompts, n_new, method="ar", draft_steps=k, width=outs[0].stats["width"],
                   **kw)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert same_logits(out, ref), (method, k, model.dtype, i)
    return outs


def wrong_in(index, model, prompts, reference):
    """A draft hook that makes every draft of prompt `index` wrong (one off the reference's token
    there), and leaves every other prompt's alone."""
    def hook(i, pos, token):
        return ((reference[i].tokens[pos - len(prompts[i])] + 1) % model.args.vocab_size
                if i == index else token)
    return hook


@pytest.mark.parametrize("kind,seed,dtype", quick([("ouro", 0, torch.float64),
                                                   ("huginn", 1, torch.float64),
                                                   ("parcae", 2, torch.float64),
                                                   ("ouro", 1, torch.float32),
                                                   ("huginn", 2, torch.float16)]
                                                  + [(kind, 1, torch.bfloat16)
                                                     for kind in ("ouro", "huginn", "parcae")],
                                                  ("ouro", 1, torch.bfloat16),
                                                  ("huginn", 2, torch.float16)),
                         ids=str)
def test_batched_wfd_and_dtv_equal_batched_ar_at_every_draft_depth(kind, seed, dtype):
    """Four prompts of different lengths through two slots (so two are refills), every k, wrong
    drafts forced in one prompt only, and a stop token the prompts reach at different times."""
    model = tiny_model(kind, seed, dtype)
    prompts = prompts_for(model, 4, seed)
    plain = batched(model, prompts, 12, method="ar", batch_size=2)
    # prompt 0 stops at its 6th token at the latest, the others when they meet it
    eos = plain[0].tokens[5]
    for k in range(1, model.num_steps + 1):
        for method in ("wfd", "dtv"):
            outs = check_against_batched_ar(model, prompts, 12, method, k, batch_size=2,
                                            eos_token_id=eos,
                                            draft_hook=wrong_in(k % 4, model, prompts, plain),
                                            draft_len=1 + k % 3)
            assert [o.stats["slot"] for o in outs] == [0, 1, 0, 1]
            wrong = outs[k % 4]
            assert wrong.stats["accepted"] == 0
            assert wrong.stats["rejected"] > 0 or k == model.num_steps or len(wrong.tokens) == 1
            assert len(outs[0].tokens) <= 6 and outs[0].tokens[-1] == eos
    # rounding too small to flip a token: each prompt's own AR's tokens too
    if dtype == torch.float64:
        for prompt, out in zip(prompts, plain):
            assert engine.generate(model, prompt, 12, method="ar", width=1).tokens == out.tokens


def test_twelve_prompts_through_four_slots_refill_exactly():
    """The refill: 12 prompts, 4 slots, bfloat16: each prompt gets batched AR's tokens and logits;
    in float64 each also gets its own single-prompt AR's tokens."""
    for dtype in (torch.bfloat16, torch.float64):
        model = tiny_model("huginn", 2, dtype)
        prompts = prompts_for(model, 12, 3, longest=12)
        eos = batched(model, prompts, 20, method="ar", batch_size=4)[5].tokens[2]
        finished = []
        outs = check_against_batched_ar(model, prompts, 20, "wfd", 2, batch_size=4,
                                        eos_token_id=eos, on_finish=lambda i, g: finished.append(i))
        assert (sorted(finished) == sorted(list(range(12)) * 2)
                and [o.stats["slot"] for o in outs] == [i % 4 for i in range(12)])
        assert all(o.stats["batch_size"] == 4 for o in outs)
        if dtype == torch.float64:
            for prompt, out in zip(prompts, outs):
                assert engine.generate(model, prompt, 20, method="ar", width=1,
                                       eos_token_id=eos).tokens == out.tokens


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_batched_sampling_with_a_seed_per_prompt(dtype):
    model = tiny_model("ouro", 1, dtype)
    prompts = prompts_for(model, 4, 5)
    # the refilled slot (prompt 3 in slot 0) takes a seed of its own: a kept key would go unseen
    sampling = dict(temperature=0.9, top_k=20, top_p=0.95, seed=[7, 8, 9, 10])
    outs = check_against_batched_ar(model, prompts, 14, "wfd", 1, batch_size=3, **sampling)
    if dtype == torch.float64:  # each prompt as if alone, with its own seed
        for prompt, out, seed in zip(prompts, outs, sampling["seed"]):
            alone = engine.generate(model, prompt, 14, method="ar", width=1,
                                    **dict(sampling, seed=seed))
            assert alone.tokens == out.tokens


@pytest.mark.parametrize("kind", quick(["ouro", "huginn", "parcae"], "huginn"))
def test_batched_shared_kv_wfd_equals_batched_shared_ar(kind):
    model = tiny_model(kind, 0, torch.float32)
    prompts = prompts_for(model, 4, 2)
    plain = batched(model, prompts, 12, method="ar", batch_size=2)
    for k in (1, 2):
        outs = check_against_batched_ar(model, prompts, 12, "wfd", k, batch_size=2, kv="shared",
                                        draft_hook=wrong_in(1, model, prompts, plain))
        assert outs[1].stats["accepted"] == 0 < outs[1].stats["rejected"]


def test_one_prompt_in_a_list_is_the_single_prompt_generation():
    """A list of one prompt runs the same calls as the prompt alone: the same bits."""
    model = tiny_model("huginn", 0, torch.bfloat16)
    prompt = prompts_for(model, 1, 0)[0]
    alone = engine.generate(model, prompt, 12, keep_logits=True)
    (listed,) = engine.generate(model, [prompt], 12, keep_logits=True)
    assert same_logits(alone, listed)


def test_batched_callbacks_take_the_prompts_index():
    model = tiny_model("ouro", 0)
    prompts = prompts_for(model, 3, 1)
    tokens, trace = {0: [], 1: [], 2: []}, []
    outs = engine.generate(model, prompts, 6, batch_size=2, on_token=lambda i,
                           t: tokens[i].append(t),
                           trace=trace)
    assert [tokens[i] for i in range(3)] == [o.tokens for o in outs]
    assert {e["index"] for e in trace} == {0, 1, 2}
    assert [o.stats["index"] for o in outs] == [0, 1, 2]


def test_batched_bad_input_names_the_prompt(monkeypatch):
    model = tiny_model("ouro", 0)
    for prompts, kw, message in [
            ([], {}, "the prompt is empty"),
            ([[1, 2], []], {}, "prompt 1: the prompt is empty"),
            ([[1, 2], 3], {}, "prompt 1 is a token id among prompts"),
            ([[1, 2], "text"], {}, "prompt 1: the prompt must be token ids"),
            ([[1, 2], [1.5]], {}, "prompt 1: prompt token ids must be integers"),
            ([[1, 2], [1, 999]], {}, "prompt 1: prompt token 999 is outside the vocabulary"),
            ([[1, 2], [3]], dict(batch_size=0), "batch_size must be an integer >= 1"),
            ([[1, 2], [3]], dict(seed=[1, 2, 3]), "3 seeds for 2 prompt(s)"),
            ([1, 2], dict(seed=[1]), "1 seeds for one prompt(s)"),
            (torch.ones(2, 3, dtype=torch.long), {}, "pass several prompts as a list"),
    ]:
        with pytest.raises((ValueError, TypeError),
                           match=message.replace("(", r"\(").replace(")", r"\)")):
            engine.generate(model, prompts, 4, **kw)
    # the cache of every slot is checked against free memory before allocating
    monkeypatch.setattr(devices, "free_memory",
                        lambda device: kv_cache.cache_bytes(model, 16, 4, None, 3) + 1)
    with pytest.raises(ValueError, match="3 sequences of 17 positions.*at most 16 positions"
                       ".*fewer new tokens, a smaller batch_size, or use"):
        engine.generate(model, [[1, 2, 3]] * 3, 15, num_steps=4)
    assert len(engine.generate(model, [[1, 2, 3]] * 3, 14, num_steps=4)) == 3
