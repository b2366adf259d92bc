"""Noise that is a function of integers alone: (key, position, channel) -> a number, the same on
every device and in every batch, lane or schedule. Huginn's random initial state draws from it
(models.LoopedLM.initial_state), and so does sampling (engine/sampling.py)."""
import math

import torch

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


PHI_MINUS_3 = 0.5 * math.erfc(3 / math.sqrt(2))  # the standard normal's CDF at -3


def truncated_normal(key, pos, n):
    """A standard normal cut at +-3 [len(pos), n], float64, from the uniforms of (key, pos, i) by
    the inverse CDF: like uniforms, a function of the integers alone."""
    u = PHI_MINUS_3 + uniforms(key, pos, n) * (1 - 2 * PHI_MINUS_3)
    return torch.special.ndtri(u).clamp(-3, 3)
