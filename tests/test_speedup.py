"""The demo's speed-up, held: the tokens are tested to the last bit elsewhere, but a broken draft
keeps AR's tokens and only costs R calls. Here the demo model (T = 4) decodes three prompts of
data/prompts.txt, 128 new tokens each, and every count that makes its speed is held exactly: the
drafts accepted and rejected, the R and C calls, and the second proposal's rescues, greedy (the
reference's wfd.generate and the engine's, which must agree) and sampled (the engine's: the
reference is greedy only), at every draft depth k. The README's run.py figures are run.py's own
output, checked here through run.main.

Where the figures come from. The tables are the counts these runs give (measured once, here). They
are also derived, apart from any schedule, from one plain pass of the model over the prompt and
the run's tokens (plain_reads): which drafts are right is what the depth-k read of each position
chooses, and the R calls follow from that (test_wfd.wavefront_r_calls). So a table row holds the
model's natural acceptance, not a figure the schedule happens to give.

Slack: none. On another CPU a draft could flip only where the top two scores of a read (logits;
sampled, logits / temperature plus the noise) tie to within that CPU's rounding. In these runs the
top two of every read the engine makes are at least 3.0e-4 apart greedy and 8.2e-4 sampled (a hook
on Decoder.read, while writing this test); float32's rounding moves those gaps by about 3e-6 (the
same gaps in float64 differ by that much), and float64 gives every count of the tables
(test_float64_gives_the_same_counts). Another CPU's float32 kernels round by about as much, a
hundredth of the nearest tie, so they choose the same tokens and these counts hold exactly."""
import os
from typing import NamedTuple

import pytest
import torch

import engine
import models
import run
import wfd
from engine.sampling import Sampling, choose
from kv import KVCache
from test_wfd import wavefront_r_calls

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
N_NEW = 128
FIB, STACK, PRIME = "def fibonacci(n):", "class Stack:", "def is_prime(n):"  # data/prompts.txt's
slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)
# the README's prompt in the quick suite, the others in the whole one
TEXTS = [FIB, slow(STACK), slow(PRIME)]
AT_EVERY_K = [(FIB, k) for k in (1, 2, 3, 4)] + [slow(text, k) for text in (STACK, PRIME)
                                                 for k in (1, 2, 3, 4)]


class Counts(NamedTuple):
    accepted: int
    rejected: int
    r_calls: int
    c_calls: int
    rescued: int = 0


def counts(stats):
    return Counts(stats["accepted"], stats["rejected"], stats["r_calls"], stats["c_calls"],
                  stats.get("rescued", 0))


# (prompt, temperature) -> k -> the counts of WFD, 128 tokens (no stop token meets them); sampled:
# seed 0. k = 4 = T drafts nothing: AR's 4 R calls and 1 C call per token
WAVEFRONT = {
    (FIB, 0.0): {1: Counts(69, 57, 305, 299), 2: Counts(107, 19, 298, 147),
                 3: Counts(116, 10, 396, 254), 4: Counts(0, 0, 512, 128)},
    (STACK, 0.0): {1: Counts(57, 69, 341, 335), 2: Counts(106, 20, 300, 149),
                   3: Counts(121, 5, 391, 254), 4: Counts(0, 0, 512, 128)},
    (PRIME, 0.0): {1: Counts(50, 76, 362, 356), 2: Counts(92, 34, 328, 163),
                   3: Counts(118, 8, 394, 254), 4: Counts(0, 0, 512, 128)},
    (FIB, 0.7): {1: Counts(53, 73, 353, 350), 2: Counts(86, 40, 340, 169),
                 3: Counts(111, 15, 401, 254), 4: Counts(0, 0, 512, 128)},
    (STACK, 0.7): {1: Counts(73, 53, 293, 287), 2: Counts(96, 30, 320, 158),
                   3: Counts(107, 19, 405, 254), 4: Counts(0, 0, 512, 128)},
    (PRIME, 0.7): {1: Counts(55, 71, 347, 338), 2: Counts(88, 38, 336, 167),
                   3: Counts(114, 12, 398, 254), 4: Counts(0, 0, 512, 128)},
}
# (prompt, temperature) -> (k, m) -> the counts of WFD with the second proposal at depth m
SECOND = {
    (FIB, 0.0): {(1, 2): Counts(69, 19, 229, 223, rescued=38),
                 (1, 3): Counts(69, 10, 258, 252, rescued=47),
                 (2, 3): Counts(107, 10, 289, 273, rescued=9)},
    (STACK, 0.0): {(1, 2): Counts(57, 20, 243, 239, rescued=49),
                   (1, 3): Counts(57, 5, 277, 272, rescued=64),
                   (2, 3): Counts(106, 2, 282, 275, rescued=18)},
    (PRIME, 0.0): {(1, 2): Counts(50, 34, 278, 274, rescued=42),
                   (1, 3): Counts(50, 8, 294, 290, rescued=68),
                   (2, 3): Counts(92, 8, 302, 289, rescued=26)},
    (FIB, 0.7): {(1, 2): Counts(53, 38, 283, 280, rescued=35),
                 (1, 3): Counts(53, 14, 294, 291, rescued=59),
                 (2, 3): Counts(86, 13, 313, 295, rescued=27)},
    (STACK, 0.7): {(1, 2): Counts(73, 27, 241, 235, rescued=26),
                   (1, 3): Counts(73, 15, 255, 249, rescued=38),
                   (2, 3): Counts(96, 19, 309, 284, rescued=11)},
    (PRIME, 0.7): {(1, 2): Counts(55, 38, 281, 276, rescued=33),
                   (1, 3): Counts(55, 12, 288, 282, rescued=59),
                   (2, 3): Counts(88, 10, 308, 293, rescued=28)},
}


@pytest.fixture(scope="module")
def demo():
    return models.load(DEMO)  # float32, the checkpoint's dtype, as run.py loads it


def plain_reads(model, prompt, tokens, temperature):
    """The plain pass, apart from every schedule: the prompt and the tokens (the last one aside,
    never fed back) through P, R and C as one prefill, every position in each call, read after
    every recurrence. reads[d][p]: the token that position p's row chooses for p + 1 at depth d
    (greedy: the argmax; sampled: the Gumbel-max rule with seed 0's noise at p + 1, which every
    depth shares, engine.sampling.choose)."""
    ids, T = prompt + tokens[:-1], model.num_steps
    pos = torch.arange(len(ids))
    cache, sampling, reads = KVCache(model, len(ids), T), Sampling(temperature), {}
    with torch.no_grad():
        s, e = model.P(torch.tensor(ids), pos, cache)
        for d in range(T):
            s = model.R(s, e, pos, d, cache)
            reads[d + 1] = choose(model.C(s, e, pos, cache), pos + 1, sampling).tolist()
    return reads


def natural_drafts(model, prompt, out, temperature):
    """right[d]: for each draft the wavefront verifies, whether the depth-d read chooses AR's token:
    the rows at positions len(prompt) .. len(prompt) + n - 3 draft the tokens 2 .. n - 1 (the
    row at the last position drafts nothing). The run's tokens are checked to be the plain pass's
    full-depth choices, AR's."""
    reads, n, L = plain_reads(model, prompt, out.tokens, temperature), len(out.tokens), len(prompt)
    assert reads[model.num_steps][L - 1:] == out.tokens
    return {d: [reads[d][p] == out.tokens[p + 1 - L] for p in range(L, L + n - 2)]
            for d in reads}


def check_natural(model, prompt, out, k, temperature):
    """The wavefront's counts at draft depth k < T against the plain pass: the drafts accepted are
    the right ones, and the R calls are test_wfd.wavefront_r_calls's."""
    right = natural_drafts(model, prompt, out, temperature)[k]
    accepted, rejected = sum(right), len(right) - sum(right)
    assert (out.stats["accepted"], out.stats["rejected"]) == (accepted, rejected), k
    assert out.stats["r_calls"] == wavefront_r_calls(model.num_steps, k, accepted, rejected), k


@pytest.mark.parametrize("text,k", AT_EVERY_K)
def test_wavefront_greedy_counts(demo, text, k, one_thread):
    """Greedy WFD: the reference's counts are the engine's, and both the table's."""
    prompt = demo.tokenizer.encode(text).ids
    ref = wfd.generate(demo, prompt, N_NEW, draft_steps=k)
    out = engine.generate(demo, prompt, N_NEW, draft_steps=k)
    assert ref.tokens == out.tokens
    assert counts(ref.stats) == counts(out.stats) == WAVEFRONT[text, 0.0][k]
    assert ref.stats["drafted"] == out.stats["drafted"]
    if k < demo.num_steps:
        check_natural(demo, prompt, out, k, 0.0)


@pytest.mark.parametrize("text,k", AT_EVERY_K)
def test_wavefront_sampled_counts(demo, text, k, one_thread):
    """Sampled WFD (temperature 0.7, seed 0), the engine's."""
    prompt = demo.tokenizer.encode(text).ids
    out = engine.generate(demo, prompt, N_NEW, draft_steps=k, temperature=0.7)
    assert counts(out.stats) == WAVEFRONT[text, 0.7][k]
    if k < demo.num_steps:
        check_natural(demo, prompt, out, k, 0.7)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_second_proposal_counts(demo, text, temperature, one_thread):
    """The second proposal (engine only) at (k, m) = (1, 2), (1, 3), (2, 3). Against the plain
    pass: the drafts accepted are the right ones; a wrong draft is rescued or rejected, rescued
    only where the depth-m read is right (and a lane was free for its sibling); and a token costs
    k R calls after an accepted draft, m after a rescue, T after a restart (docs/siblings.md)."""
    prompt, T = demo.tokenizer.encode(text).ids, demo.num_steps
    right = None
    for (k, m), want in SECOND[text, temperature].items():
        out = engine.generate(demo, prompt, N_NEW, draft_steps=k, second_depth=m,
                              temperature=temperature)
        right = right or natural_drafts(demo, prompt, out, temperature)
        got = counts(out.stats)
        assert got == want, (k, m)
        assert got.accepted == sum(right[k]) and got.rescued + got.rejected == right[k].count(False)
        assert got.rescued <= sum(m_ok and not k_ok for k_ok, m_ok in zip(right[k], right[m]))
        assert got.r_calls == (wavefront_r_calls(T, k, got.accepted, got.rejected)
                               + got.rescued * m), (k, m)


def test_run_py_prints_the_readmes_figures(capsys, one_thread):
    """The README's run.py example, `python run.py --prompt "def fibonacci(n):"` (the demo, 128
    tokens, k = 2, float32): 298 R calls (2.33 per token), acceptance 0.85; with --temperature 0.7:
    340 R calls, acceptance 0.68; the reference's loop prints the engine's greedy figures."""
    for flags, line in (([], "[wfd] 128 tokens, 298 R calls (2.33/token), T=4 k=2 width 2, "
                             "acceptance 0.85, "),
                        (["--temperature", "0.7"], "[wfd] 128 tokens, 340 R calls (2.66/token), "
                         "T=4 k=2 width 2, acceptance 0.68, "),
                        (["--engine", "reference"], "[reference wfd] 128 tokens, 298 R calls "
                         "(2.33/token), T=4 k=2, acceptance 0.85, ")):
        run.main(["--prompt", FIB] + flags)
        assert line in capsys.readouterr().out, flags


@pytest.mark.slow
def test_float64_gives_the_same_counts(one_thread):
    """Every count of the tables again in float64, the engine's: none of them hangs on float32's
    rounding (the slack's reason, in the module's docstring)."""
    model = models.load(DEMO, dtype=torch.float64)
    for (text, temperature), table in WAVEFRONT.items():
        prompt = model.tokenizer.encode(text).ids
        for k, want in table.items():
            out = engine.generate(model, prompt, N_NEW, draft_steps=k, temperature=temperature)
            assert counts(out.stats) == want, (text, temperature, k)
        for (k, m), want in SECOND[text, temperature].items():
            out = engine.generate(model, prompt, N_NEW, draft_steps=k, second_depth=m,
                                  temperature=temperature)
            assert counts(out.stats) == want, (text, temperature, k, m)
