"""The speed baseline of bench.py's "plain" row: greedy AR as a plain eager forward decodes, one row
per call and one SDPA call per layer over the cached prefix, in a KV cache that grows by a column
a token; no lanes, key blocks, masks, staging or schedule. It runs the model's own P, R and C (the
same layers and weights), so that the gap to this project's AR is what its decoder and blocked
cache cost. Its tokens equal AR's (bench.py checks them, and a test); its logits are another
computation's, equal to AR's only up to rounding."""
import torch
import torch.nn.functional as F

from kv import causal_attention


class PlainCache:
    """A per-depth KV cache as a plain forward keeps it, in the calls' cache interface (kv.KVCache's
    span, prepare and attend): looped layer j at depth d in slot d * n_core + j, prelude and coda
    after. `start`, set before each call on the host, is the position of its first row."""

    def __init__(self, model, capacity):
        a = model.args
        self.n_core, self.num_steps, self.start = a.n_core, model.num_steps, 0
        self.depth_slots = self.num_steps * a.n_core
        shape = (self.depth_slots + a.n_prelude + a.n_coda, a.n_kv_heads, capacity, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    def span(self, top, prefill=False, bucket=False):
        return 0 if prefill else 1

    def prepare(self, pos, depth, span, sums=False, branches=None, rows=None):
        return depth or 0  # every row of a call at one depth

    def attend(self, depth, layer, q, k, v):
        """Write the rows' keys and values at their positions; the prompt attends causally among
        its rows, a new token to the whole prefix, in one SDPA call."""
        slot = depth * self.n_core + layer if layer < self.n_core else (
            self.depth_slots + layer - self.n_core)
        p, n = self.start, len(q)
        self.k[slot, :, p:p + n], self.v[slot, :, p:p + n] = k.transpose(0, 1), v.transpose(0, 1)
        if n > 1:
            return causal_attention(q, k, v)
        keys, values = self.k[slot, :, :p + 1], self.v[slot, :, :p + 1]  # [Hkv, p + 1, hd]
        y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                           enable_gqa=True)  # [1, H, 1, hd]
        return y[0].transpose(0, 1)


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens, stop=(), on_token=None):
    """Greedy decoding of one prompt, a token at a time at the model's full depth: (the new tokens,
    the bytes of its KV cache)."""
    n, T = len(prompt_ids), model.num_steps
    cache, tokens = PlainCache(model, n + max_new_tokens), []
    ids, pos, last = torch.tensor(prompt_ids), torch.arange(n), [n - 1]
    while True:
        e, s = model.P(ids, pos, cache)
        for d in range(T):
            s = model.R(s, e, pos, d, cache)
        token = model.C(s, e, pos, cache, rows=last).argmax(-1).item()
        tokens.append(token)
        if on_token:
            on_token(token)
        if token in stop or len(tokens) >= max_new_tokens:
            return tokens, cache.k.nbytes + cache.v.nbytes
        cache.start = n + len(tokens) - 1
        ids, pos, last = torch.tensor([token]), torch.tensor([cache.start]), None
