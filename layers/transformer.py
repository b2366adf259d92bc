"""The transformer layer the families share, and its parts: RMSNorm, RoPE (with Llama-3's
scaling), the block with its norm placements, MLPs, Parcae's value embeddings and LoopFormer's
modulation, and the conditioning pieces of two families: Parcae's diagonal injection, LoopFormer's
clock. Every difference between the families is a flag of models.ModelArgs (`a`), read here."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VE_GATE_CHANNELS = 32  # Parcae's value-embedding gate reads this many channels of its input
QK_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default, which Parcae's QK-norm uses
CLOCK_FEATURES = 256  # LoopFormer's sinusoidal features of t and dt: 128 cosines, then 128 sines


def rope_table(a):
    """cos, sin [max_seq_len, head_dim/2], computed in fp32 as the references do."""
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32)
                                      / a.head_dim)
    if a.rope_scaling:
        inv_freq = llama3_scaling(inv_freq, *a.rope_scaling)
    angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def llama3_scaling(inv_freq, factor, low, high, original):
    """Llama-3's RoPE frequencies: wavelengths under original / high kept, over original / low
    divided by factor, and between them a blend by where original / wavelength lies in low..high."""
    wavelength = 2 * math.pi / inv_freq
    blend = (original / wavelength - low) / (high - low)
    mid = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelength < original / high, inv_freq,
                       torch.where(wavelength > original / low, inv_freq / factor, mid))


def rms_norm(x, weight, eps):
    # statistics in at least fp32, cast back to the input dtype *before* the weight (the
    # references); eps None: nn.RMSNorm's default, the epsilon of that arithmetic's dtype.
    # F.rms_norm is one call, with the bits of x * rsqrt(mean(x^2) + eps) (* weight)
    if x.element_size() < 4:
        xf = x.float()
        y = F.rms_norm(xf, x.shape[-1:], None, torch.finfo(xf.dtype).eps if eps is None else eps)
        return y.to(x.dtype) if weight is None else y.to(x.dtype) * weight
    return F.rms_norm(x, x.shape[-1:], weight, torch.finfo(x.dtype).eps if eps is None else eps)


def apply_rope(x, cos, sin, interleaved):
    """x [N, heads, hd]; cos, sin [N, 1, hd/2] in x's arithmetic dtype (at least fp32: the model's
    rope_rows). Rotates adjacent pairs (interleaved) or the halves."""
    xf = x.float() if x.element_size() < 4 else x
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def value_gate(h, weight):
    """Parcae's value-embedding gate, per kv head: 2 sigmoid(g) in (0, 2) of g = h W^T, read from
    the normed input h [..., N, D]; [..., N, Hkv]. Written so that a row's bits do not depend on
    its lane in the call (docs/exactness.md): the few outputs as products and sums (a matmul this
    narrow gives a row other bits in another lane), and 2 sigmoid(g) as 2 / (1 + exp(-g)) (the CPU's
    sigmoid, and a compiled tanh, take the last elements of a tensor another way)."""
    g = (h[..., None, :VE_GATE_CHANNELS] * weight).sum(-1)
    return 2 / (1 + torch.exp(-g))


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


MLPS = {"swiglu": swiglu, "relu2": lambda h: 0.5 * F.relu(h).square(), "gelu": F.gelu}  # a.mlp


class Block(nn.Module):
    """One transformer layer: RMSNorms on the attention's and the MLP's input (ModelArgs.in_norm),
    on their outputs (ModelArgs.sandwich; before or after the residual add: ModelArgs.post_norm), or
    both. ve_cols: the columns of the value embeddings (P's lookup, R's and C's e) it mixes into v.
    mod (LoopFormer): the block's modulation at each row's clock, [..., 4D] (gates and scales)."""

    def __init__(self, a, layer_id: int, hidden_dim: int, ve_cols: slice = None):
        super().__init__()
        self.args, self.layer_id = a, layer_id  # layer_id addresses this layer's KV slots in kv.py
        self.qkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, a.n_heads, a.head_dim)) if a.qk_bias else None
        self.proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        gated = a.mlp == "swiglu"  # fc's rows: [gate; up]
        self.fc = nn.Linear(a.dim, (2 if gated else 1) * hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, a.dim, bias=False)
        norm = lambda width, on: nn.Parameter(torch.ones(width)) if on else None
        weighted_in = a.in_norm and a.norm_weights
        self.attn_norm, self.attn_out_norm = norm(a.dim, weighted_in), norm(a.dim, a.sandwich)
        self.mlp_norm, self.mlp_out_norm = norm(a.dim, weighted_in), norm(a.dim, a.sandwich)
        self.q_norm = norm(a.n_heads * a.head_dim, a.qk_proj_norm)
        self.k_norm = norm(a.n_kv_heads * a.head_dim, a.qk_proj_norm)
        self.ve_cols = ve_cols
        self.ve_gate = (nn.Linear(VE_GATE_CHANNELS, a.n_kv_heads, bias=False)
                        if ve_cols is not None else None)
        self.ada = nn.Linear(a.dim, 4 * a.dim) if a.clock else None  # LoopFormer's adaLN_modulation

    def forward(self, x, cos, sin, attend, ve=None, mod=None):  # x [..., N, D]; ve [..., N, cols]
        """cos, sin: the rows' RoPE rows (models.LoopedLM.rope). For WFD one line matters,
        attend(q, k, v); the rest is the families' flags (ModelArgs)."""
        a = self.args
        gate_attn, gate_mlp, scale_attn, scale_mlp = [None] * 4 if mod is None else mod.chunk(4, -1)
        h = self.sublayer_input(x, self.attn_norm, scale_attn)
        heads, kv_width = a.n_heads, a.n_kv_heads * a.head_dim
        qk, v = F.linear(h, self.qkv.weight).split([heads * a.head_dim + kv_width, kv_width], -1)
        if self.q_norm is not None:  # OLMo-2: over the whole projection, every head at once
            q, k = qk.split([heads * a.head_dim, kv_width], -1)
            qk = torch.cat([rms_norm(q, self.q_norm, a.norm_eps),
                            rms_norm(k, self.k_norm, a.norm_eps)], -1)
        # q's heads, then k's: RoPE and the QK-norm act on each head alike, so on both at once
        qk, v = qk.unflatten(-1, (-1, a.head_dim)), v.unflatten(-1, (-1, a.head_dim))
        if self.ve_gate is not None:
            gate = value_gate(h, self.ve_gate.weight)
            v = v + gate[..., None] * ve[..., self.ve_cols].unflatten(-1, (-1, a.head_dim))
        if self.qk_bias is not None:  # [2, 1, heads, hd]: q's, then k's
            qk = qk + self.qk_bias.transpose(0, 1).flatten(1, 2)
        if a.rope:
            qk = apply_rope(qk, cos, sin, a.interleaved_rope)
        if a.qk_norm:
            qk = rms_norm(qk, None, QK_NORM_EPS)
        q, k = qk.split([heads, a.n_kv_heads], -2)
        y = F.linear(attend(q, k, v).flatten(-2), self.proj.weight)  # kv.KVCache.attend (WFD)
        x = self.residual(x, y, self.attn_out_norm, gate_attn)
        h = F.linear(self.sublayer_input(x, self.mlp_norm, scale_mlp), self.fc.weight)
        return self.residual(x, F.linear(MLPS[a.mlp](h), self.down.weight), self.mlp_out_norm,
                             gate_mlp)

    def sublayer_input(self, x, norm, scale):
        """What the attention or the MLP reads: x, normed (ModelArgs.in_norm) and, modulated
        (LoopFormer), times 1 + scale."""
        h = rms_norm(x, norm, self.args.norm_eps) if self.args.in_norm else x
        return h if scale is None else h * (1 + scale)

    def residual(self, x, h, norm, gate=None):
        h = h if gate is None else gate * h  # LoopFormer: the sub-layer's output gated per channel
        if norm is None:
            return x + h
        if self.args.post_norm:
            return rms_norm(h + x, norm, self.args.norm_eps)
        return x + rms_norm(h, norm, self.args.norm_eps)


class DiagonalInjection(nn.Module):
    """Parcae's s <- s * exp(-softplus(dt_bias) * exp(A_log)) + softplus(dt_bias) * (e B^T), per
    channel. The input term depends on the token alone: P makes it once per row (input), R adds
    it."""

    def __init__(self, dim):
        super().__init__()
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        self.B = nn.Parameter(torch.eye(dim))

    def decay(self):
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def input(self, e):
        return F.softplus(self.dt_bias) * F.linear(e, self.B)


class Clock(nn.Module):
    """LoopFormer's conditioning c = E_time(t) + E_dt(dt) of an iteration at time t with step dt:
    each E(tau) = W2 silu(W1 phi(tau) + b1) + b2, of phi(tau) = [cos(tau f), sin(tau f)] (cosines
    first), f_i = 10000^(-i/128), computed in fp32 from tau and cast to the weights' dtype."""

    def __init__(self, dim):
        super().__init__()
        mlp = lambda: nn.Sequential(nn.Linear(CLOCK_FEATURES, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time, self.step = mlp(), mlp()

    def forward(self, t, dt):  # t, dt [B] -> c [B, D]
        return self.time(self.features(t)) + self.step(self.features(dt))

    def features(self, tau):
        half = CLOCK_FEATURES // 2
        i = torch.arange(half, dtype=torch.float32, device=tau.device)
        freqs = torch.exp(-math.log(10000) * i / half)
        angles = tau[:, None].float() * freqs[None]
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.time[0].weight.dtype)


def causal_attention(q, k, v):
    """Attention of positions 0..N-1 among themselves (q, k, v [..., N, heads, hd]): the full
    forward without a cache, and the engine's prefill. 4-D, so that SDPA's fused kernels take it."""
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]).transpose(1, 2) for t in (q, k, v))  # [B, H, N, hd]
    y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).reshape(q.shape)
