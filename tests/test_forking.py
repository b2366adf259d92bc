"""docs/forking.md's worked example: a toy looped family made only through the extension points
the page names (ModelArgs' flags, a subclass of models.LoopedLM overriding one method), decoded by
the reference and the engine, whose WFD must give its AR's tokens (the page quotes this file)."""
import os
import re

import torch

import engine
import models
import wfd

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "forking.md")

# -- docs/forking.md quotes from here --


class AddedInputLM(models.LoopedLM):
    """Ouro's blocks looped on s <- norm(core(s + e)), e the token's embedding, from s0 = 0: the
    input injection of the looped transformers that add the input before every iteration."""

    def __init__(self, a, **kw):
        super().__init__(a, **kw)
        self.adapter = None  # inject=True gives R each row's e; this family adds it, no adapter

    def inject(self, s, e):  # the core's input at every recurrence
        return s + e


def added_input_model(seed=0, dtype=torch.float64):
    a = models.ModelArgs(
        kind="added_input", dim=32, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
        vocab_size=48, n_prelude=0, n_core=2, n_coda=0, num_steps=4, rope_theta=10000.0,
        norm_eps=1e-6, max_seq_len=64, tie_embeddings=False,
        inject=True, norm_each_step=True, post_norm=False, interleaved_rope=False,
        embed_scale=1.0)
    torch.manual_seed(seed)  # random weights: nn.Module's own initialisation
    model = AddedInputLM(a, state_init="zero")
    return model.to(dtype).eval().requires_grad_(False)

# -- to here --


def test_the_docs_example_is_this_files():
    """The page's code block is the block above, character for character."""
    with open(__file__) as f:
        here = re.search(r"# -- docs/forking.md quotes from here --\n\n\n(.*?)\n# -- to here --",
                         f.read(), re.S).group(1)
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert here in blocks


def greedy_by_full_forwards(model, prompt, n_new):
    """Greedy decoding with no cache and no schedule: a forward of the whole sequence per token."""
    ids = list(prompt)
    for _ in range(n_new):
        ids.append(int(model.logits(ids)[-1].argmax()))
    return ids[len(prompt):]


def test_a_new_family_decodes_by_wfd_as_by_ar():
    """The toy family in float64: the reference's AR equals greedy decoding by full forwards; its
    WFD (the drafts as read at k = 1, every one forced wrong at k = 2) equals its AR, and the
    engine's WFD the engine's AR bit for bit, with the reference's tokens. The injection is live:
    without it the logits differ."""
    model, prompt, n_new = added_input_model(), [3, 17, 5, 40], 8
    wrong = lambda pos, token: (token + 1) % model.args.vocab_size
    ar = wfd.generate(model, prompt, n_new, method="ar", keep_logits=True)
    assert ar.tokens == greedy_by_full_forwards(model, prompt, n_new)
    engine_ar = engine.generate(model, prompt, n_new, method="ar", width=4, keep_logits=True)
    assert engine_ar.tokens == ar.tokens
    for k, hook in ((1, None), (2, wrong)):
        out = wfd.generate(model, prompt, n_new, method="wfd", draft_steps=k, draft_hook=hook,
                           keep_logits=True)
        assert out.tokens == ar.tokens, k
        # to float64's rounding: a row's attention may sum in another order beside other rows
        assert torch.allclose(torch.stack(out.logits), torch.stack(ar.logits), rtol=0, atol=1e-9)
        assert out.stats["drafted"] > 0
        if hook is wrong:  # each forced draft is rejected by its verify
            assert out.stats["accepted"] == 0 and out.stats["rejected"] > 0
        out = engine.generate(model, prompt, n_new, method="wfd", draft_steps=k, width=4,
                              draft_hook=hook, keep_logits=True)
        assert out.tokens == engine_ar.tokens, k
        assert torch.equal(torch.stack(out.logits), torch.stack(engine_ar.logits)), k
    plain = added_input_model()
    plain.inject = lambda s, e: s
    assert not torch.equal(plain.logits(prompt), model.logits(prompt))
