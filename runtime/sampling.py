"""Sampling that every schedule reproduces exactly (docs/sampling.md): the Gumbel-max rule with
noise that is a function of (seed, position, token) alone, so a draft and the full-depth token at a
position are drawn with the same noise, and a row's draw does not depend on its batch."""
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0

    def on(self, device):
        """The settings as tensors on `device`: a compiled read takes them as inputs, so that one
        graph serves every seed, temperature, k and p; only greedy or not, and which filters are on,
        shape the graph."""
        t = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)
        return Sampler(self.temperature == 0, t(self.temperature, torch.float64),
                       None if self.top_k is None else t(self.top_k, torch.int64),
                       None if self.top_p is None or self.top_p >= 1
                       else t(self.top_p, torch.float64),
                       t(seed_key(self.seed), torch.int64))


class Sampler(NamedTuple):
    greedy: bool
    temperature: torch.Tensor    # float64 []
    top_k: Optional[torch.Tensor]  # int64 []
    top_p: Optional[torch.Tensor]  # float64 []
    key: torch.Tensor            # int64 []: the seed folded to 32 bits (seed_key)


M32 = 0xFFFFFFFF


def mix32(x):
    """lowbias32 (C. Wellons' hash prospector), on 32-bit values held in int64. Every product stays
    below 2^63, so CPU and GPU compute the same integers: an int64 overflow would be undefined."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    # x * 0x846CA68B, its top bit's product added apart
    x = (x * 0x046CA68B + ((x & 1) << 31)) & M32
    return x ^ (x >> 16)


def seed_key(seed):
    """Any seed >= 0 folded into 32 bits, 32 bits at a time, on the host."""
    if seed < 0:  # its shifts would never reach 0
        raise ValueError(f"seed must be an integer >= 0, not {seed}")
    key = 0
    while True:
        key, seed = mix32((key + (seed & M32) + 0x9E3779B9) & M32), seed >> 32
        if not seed:
            return key


def uniforms(key, pos, n):
    """Uniforms u(key, pos, i) in (0, 1) [len(pos), n], float64, on pos's device: a function of
    the three integers alone (never 0 or 1), whichever batch or lane a row comes in. key: a 32-bit
    key (seed_key), an int or an int64 tensor; pos: int64 [N]."""
    row = mix32(pos ^ key)  # positions are far below 2^32
    h = mix32((row[:, None] + mix32(torch.arange(n, device=pos.device))) & M32)
    return (h.double() + 0.5) * 2.0 ** -32


def gumbel(key, pos, vocab):
    """Gumbel noise g(key, pos, v) [n, vocab], float64: -log(-log(u)) of the uniforms."""
    return uniforms(key, pos, vocab).log_().neg_().log_().neg_()


PHI_MINUS_3 = 0.5 * math.erfc(3 / math.sqrt(2))  # the standard normal's CDF at -3


def truncated_normal(key, pos, n):
    """A standard normal cut at +-3 [len(pos), n], float64, from the uniforms of (key, pos, i) by
    the inverse CDF: like uniforms, a function of the integers alone."""
    u = PHI_MINUS_3 + uniforms(key, pos, n) * (1 - 2 * PHI_MINUS_3)
    return torch.special.ndtri(u).clamp(-3, 3)


def choose(logits, pos, sampling):
    """The tokens at positions `pos` [n] from the logits [n, V] of the rows before them, int64 [n]
    on the logits' device, without a host sync. sampling: a Sampling, or its tensors (Sampling.on).
    Temperature 0: argmax. Else the Gumbel-max rule: argmax over the allowed tokens of logits /
    temperature + gumbel(seed, pos, v), an exact sample of the filtered softmax. Drafts and full
    depth use it alike, so a draft is right iff it equals AR's token. Filters: top-k keeps the
    logits >= the k-th largest (ties included); then top-p keeps the tokens whose probability
    (softmax of logits / temperature) is >= that of the last token of the shortest prefix, in
    descending order, whose probabilities sum to top_p (ties included again)."""
    s = sampling.on(logits.device) if isinstance(sampling, Sampling) else sampling
    if s.greedy:
        return logits.argmax(-1)
    z = logits.double() / s.temperature
    if s.top_k is not None:  # the k-th largest by a sort, since topk takes k as a Python int only
        kth = (s.top_k.clamp(max=z.shape[-1]) - 1).expand(len(z), 1)
        z = z.masked_fill(z < z.sort(-1, descending=True).values.gather(-1, kth), -math.inf)
    if s.top_p is not None:
        probs = z.softmax(-1)
        ranked = probs.sort(descending=True).values
        # probability of the tokens ranked before each; 0 for the first
        above = ranked.cumsum(-1) - ranked
        last = (above < s.top_p).sum(-1, keepdim=True) - 1
        z = z.masked_fill(probs < ranked.gather(-1, last), -math.inf)
    return (z + gumbel(s.key, pos.to(z.device), z.shape[-1])).argmax(-1)
