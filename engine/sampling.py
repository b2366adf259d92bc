"""Sampling that every schedule reproduces exactly (docs/sampling.md): the Gumbel-max rule with
noise that is a function of (seed, position, token) alone, so a draft and the full-depth token at a
position are drawn with the same noise, and a row's draw does not depend on its batch."""
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from layers.noise import seed_key, uniforms


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


def gumbel(key, pos, vocab):
    """Gumbel noise g(key, pos, v) [n, vocab], float64: -log(-log(u)) of the uniforms."""
    return uniforms(key, pos, vocab).log_().neg_().log_().neg_()


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
