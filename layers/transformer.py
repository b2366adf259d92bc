"""The transformer layer the families share, and its parts: RMSNorm, RoPE, the block with its norm
placements, MLPs and Parcae's value embeddings, and Parcae's diagonal injection. Every difference
between the families is a flag of models.ModelArgs (`a`), read here; models.py loops the layers."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VE_GATE_CHANNELS = 32  # Parcae's value-embedding gate reads this many channels of its input
QK_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default, which Parcae's QK-norm uses


def rope_table(a):
    """cos, sin [max_seq_len, head_dim/2], computed in fp32 as both references do."""
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32)
                                      / a.head_dim)
    angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rms_norm(x, weight, eps):
    # statistics in at least fp32, cast back to the input dtype *before* the weight (the references)
    xf = x.float() if x.element_size() < 4 else x
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


def apply_rope(x, cos, sin, interleaved):
    """x [N, heads, hd]; cos, sin [N, hd/2]. Rotates adjacent pairs (interleaved) or the halves."""
    xf = x.float() if x.element_size() < 4 else x
    cos, sin = cos[:, None].to(xf.dtype), sin[:, None].to(xf.dtype)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Block(nn.Module):
    """One transformer layer: RMSNorms on the attention's and the MLP's input, and with
    ModelArgs.sandwich on their outputs too (before or after the residual add: ModelArgs.post_norm).
    ve_cols: the columns of the value embeddings (P's lookup, R's and C's e) it mixes into v."""

    def __init__(self, a, layer_id: int, hidden_dim: int, ve_cols: slice = None):
        super().__init__()
        self.args, self.layer_id = a, layer_id  # layer_id addresses this layer's KV slots in kv.py
        self.qkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, a.n_heads, a.head_dim)) if a.qk_bias else None
        self.proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.fc = nn.Linear(a.dim, (2 if a.gated_mlp else 1) * hidden_dim, bias=False)  # [gate; up]
        self.down = nn.Linear(hidden_dim, a.dim, bias=False)
        norm = lambda: nn.Parameter(torch.ones(a.dim))
        self.attn_norm, self.attn_out_norm = norm(), norm() if a.sandwich else None
        self.mlp_norm, self.mlp_out_norm = norm(), norm() if a.sandwich else None
        self.ve_cols = ve_cols
        self.ve_gate = (nn.Linear(VE_GATE_CHANNELS, a.n_kv_heads, bias=False)
                        if ve_cols is not None else None)

    def forward(self, x, cos, sin, attend, ve=None):  # x [..., N, D]; ve [..., N, columns]
        a = self.args
        h = rms_norm(x, self.attn_norm, a.norm_eps)
        kv_width = a.n_kv_heads * a.head_dim
        q, k, v = self.qkv(h).split([a.n_heads * a.head_dim, kv_width, kv_width], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, a.head_dim)) for t in (q, k, v))  # [..., N, heads, hd]
        if self.ve_gate is not None:  # per kv head, a gate in (0, 2) read from the normed input
            gate = 2 * torch.sigmoid(self.ve_gate(h[..., :VE_GATE_CHANNELS]))
            v = v + gate[..., None] * ve[..., self.ve_cols].unflatten(-1, (-1, a.head_dim))
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = (apply_rope(t, cos, sin, a.interleaved_rope) for t in (q, k))
        if a.qk_norm:
            q, k = rms_norm(q, None, QK_NORM_EPS), rms_norm(k, None, QK_NORM_EPS)
        x = self.residual(x, self.proj(attend(q, k, v).flatten(-2)), self.attn_out_norm)
        h = self.fc(rms_norm(x, self.mlp_norm, a.norm_eps))
        if a.gated_mlp:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = 0.5 * F.relu(h).square()
        return self.residual(x, self.down(h), self.mlp_out_norm)

    def residual(self, x, h, norm):
        if norm is None:
            return x + h
        if self.args.post_norm:
            return rms_norm(h + x, norm, self.args.norm_eps)
        return x + rms_norm(h, norm, self.args.norm_eps)


class DiagonalInjection(nn.Module):
    """Parcae's s <- s * exp(-softplus(dt_bias) * exp(A_log)) + softplus(dt_bias) * (e B^T), per
    channel.
    The input term depends on the token alone: P makes it once per row (input), R adds it."""

    def __init__(self, dim):
        super().__init__()
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        self.B = nn.Parameter(torch.eye(dim))

    def decay(self):
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def input(self, e):
        return F.softplus(self.dt_bias) * F.linear(e, self.B)
