"""Ouro, Huginn and Parcae, three looped LMs, read from raw checkpoints and driven through three calls.

    P(ids, pos)               -> (e, s0)  embed the tokens (Huginn, Parcae: and run the prelude); initial state
    R(s, e, pos, depth)       -> s        one recurrence of the weight-shared block, for rows that may
                                          sit at different positions and different depths
    C(s, e, pos)              -> logits   read a state out (Huginn: ln_f, coda, ln_f; then lm_head)

           Ouro (Ouro-1.4B/2.6B)       Huginn (huginn-0125)                 Parcae (parcae-140m ... 1.3b)
    P      s0 = embed(ids)             e = prelude(embed(ids) * sqrt(D))    x = ln_prelude(prelude(embed(ids)))
                                       s0 = zero/random                     e = [softplus(dt) * (x B^T), ve]
    R      s = norm(layers(s))         s = core(adapter(concat(s, e)))      s = core(s * decay + e)
    C      lm_head(s)                  lm_head(ln_f(coda(ln_f(s))))         lm_head(ln_f(coda(s C^T)))

e holds what a row's recurrences and read need of its token besides the state, made once by P and
kept per lane by the decoder: Huginn's prelude output; Parcae's injection term and the token's value
embeddings (tables looked up by token id that some blocks mix into v, inside every recurrence too).

A row is one token position at one depth (completed recurrences). Every recurrent layer applied at
depth d reads and writes KV slot d, so rows at different depths can share one batched R call: the
matmuls see a plain [rows, D] batch, and only attention cares which depth a row is at (kv.py).
"""
import hashlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

# the checkpoint formats live in checkpoints.py; models.load, models.save and the rest stay the API
from checkpoints import load, load_tokenizer, read_json, resolve, save, stop_tokens  # noqa: F401
from kv import causal_attention, free_memory

# a family is named by config.json's model_type (Hugging Face configs) or, for Parcae's dump of its
# config class, by _class_name
SUPPORTED = {"ouro": "Ouro (ByteDance/Ouro-1.4B, Ouro-2.6B)", "huginn_raven": "Huginn (tomg-group-umd/huginn-0125)",
             "ParcaeConfig": "Parcae (SandyResearch/parcae-140m ... parcae-1.3b)"}
UNSUPPORTED = {
    "ouro": {"rope_scaling": lambda v: v is None, "use_sliding_window": lambda v: not v,
             "hidden_act": lambda v: v == "silu"},
    "huginn_raven": {"injection_type": lambda v: v == "linear", "nonlin_name": lambda v: v == "SiLU",
                     "bias": lambda v: not v, "test_time_noise": lambda v: not v},
    "ParcaeConfig": {"injection_type": lambda v: v == "diagonal", "block_class_name": lambda v: v == "TransformerPreNormBlock",
                     "norm_class_name": lambda v: v == "RMSNorm", "mlp_class_name": lambda v: v == "BaseMLP",
                     "nonlin_name": lambda v: v == "ReLU2", "bias": lambda v: not v, "qk_bias": lambda v: not v,
                     "clip_qkv": lambda v: v is None, "logit_softcap": lambda v: v is None,
                     # other init strategies scale the embedding or the logits, and change like-init's sigma
                     "init_strategy": lambda v: v == "scaled-zero", "mup_model_scaling_factor": lambda v: v == 1,
                     "state_init": lambda v: v in ("like-init", "zero"),
                     "rope_settings": lambda v: not v or v.get("use_rope", True) and v.get("rope_condense_ratio", 1) == 1},
}
VE_GATE_CHANNELS = 32                    # Parcae's value-embedding gate reads this many channels of its input
QK_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default, which Parcae's QK-norm uses


@dataclass
class ModelArgs:
    kind: str              # "ouro" or "huginn"
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int        # SwiGLU width
    vocab_size: int
    n_prelude: int         # Huginn only; 0 for Ouro
    n_core: int            # the looped layers
    n_coda: int            # Huginn only; 0 for Ouro
    num_steps: int         # default full depth T
    rope_theta: float
    norm_eps: float
    max_seq_len: int       # length of the RoPE table: the model's context
    tie_embeddings: bool
    qk_bias: bool          # Huginn: learned bias on q and k, added before RoPE
    # what sets the families apart, decided here once, so that the forward code has no family branches
    inject: bool           # Huginn: P runs a prelude whose output e every recurrence reads through an
                           # adapter, and s0 is a fresh latent; Ouro: s0 is the embedding
    norm_each_step: bool   # Ouro: the final norm after every recurrence; Huginn: around the coda in C
    post_norm: bool        # Huginn: norm(x + f(x)); Ouro: x + norm(f(x))
    interleaved_rope: bool # Huginn rotates adjacent pairs, Ouro the two halves
    embed_scale: float     # Huginn: sqrt(D); Ouro, Parcae: 1
    init_std: float = 0.0  # Huginn, Parcae: sigma of the "like-init" random initial state (times embed_scale)
    injection: str = "adapter"      # how R reads e: Huginn's adapter over concat(s, e), Parcae's "diagonal"
    sandwich: bool = True           # four norms per block; Parcae's pre-norm blocks have the input ones only
    qk_norm: bool = False           # Parcae: a weightless RMS norm on q and k, after RoPE
    gated_mlp: bool = True          # SwiGLU; Parcae: 0.5 * relu(x)^2, not gated
    core_hidden_dim: int = 0        # MLP width of the looped layers, when not hidden_dim
    prelude_norm: bool = False      # Parcae: ln_prelude on the prelude's output
    coda_in: bool = False           # Parcae: the linear map C of the final state into the coda
    norm_before_coda: bool = False  # Huginn: ln_f on the state before the coda too
    # Parcae's value embeddings, by block (0.. over prelude, core, coda): the blocks whose table the
    # checkpoint holds, and those with a gate; a block mixes one in where it has both
    ve_tables: tuple = ()
    ve_gates: tuple = ()

    @staticmethod
    def from_config(c: dict) -> "ModelArgs":
        key = "model_type" if "model_type" in c or "_class_name" not in c else "_class_name"
        model_type = c.get(key)
        if model_type not in SUPPORTED:
            raise ValueError(f"unknown {key} {model_type!r} in config.json; supported: "
                             + ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED.items()))
        # settings the official code has and this one does not: refuse rather than run another model
        bad = [f"{k}={c[k]!r}" for k, ok in UNSUPPORTED[model_type].items() if k in c and not ok(c[k])]
        if bad:
            raise ValueError(f"config.json asks for what this implementation does not support: {', '.join(bad)}")
        try:
            return ModelArgs._parse(model_type, c)
        except KeyError as err:
            raise ValueError(f"config.json lacks {err.args[0]!r}, needed for a {model_type} model") from None

    @staticmethod
    def _parse(model_type, c):
        if model_type == "ouro":
            heads = c["num_attention_heads"]
            return ModelArgs(
                kind="ouro", dim=c["hidden_size"], n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads") or heads,
                head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                hidden_dim=c["intermediate_size"], vocab_size=c["vocab_size"],
                n_prelude=0, n_core=c["num_hidden_layers"], n_coda=0,
                num_steps=c.get("total_ut_steps", 4), rope_theta=float(c.get("rope_theta", 1e6)),
                norm_eps=c.get("rms_norm_eps", 1e-6), max_seq_len=c["max_position_embeddings"],
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), qk_bias=False,
                inject=False, norm_each_step=True, post_norm=False, interleaved_rope=False, embed_scale=1.0)
        if model_type == "huginn_raven":
            dim, heads = c["n_embd"], c["n_heads"]
            return ModelArgs(
                kind="huginn", dim=dim, n_heads=heads, n_kv_heads=heads,  # plain MHA, forced by the config class
                head_dim=dim // heads, hidden_dim=c["intermediate_size"],
                vocab_size=c.get("padded_vocab_size") or c["vocab_size"],
                n_prelude=c["n_layers_in_prelude"], n_core=c["n_layers_in_recurrent_block"],
                n_coda=c["n_layers_in_coda"], num_steps=c.get("mean_recurrence", 32),
                rope_theta=float(c.get("rope_base", 50000.0)), norm_eps=c.get("norm_eps", 1e-6),
                max_seq_len=c["block_size"], tie_embeddings=bool(c.get("tie_embeddings", True)),
                qk_bias=bool(c.get("qk_bias", True)), inject=True, norm_each_step=False, post_norm=True,
                interleaved_rope=True, embed_scale=math.sqrt(dim),
                init_std=(c.get("init_values") or {}).get("std", math.sqrt(2 / (5 * dim))), norm_before_coda=True)
        return ModelArgs._parse_parcae(c)

    @staticmethod
    def _parse_parcae(c):
        dim, heads = c["n_embd"], c["num_attention_heads"]
        # layouts the released checkpoints do not use, and this code does not run
        if c.get("recurrent_embedding_dimension", dim) != dim:
            raise ValueError(f"recurrent_embedding_dimension {c['recurrent_embedding_dimension']} differs from "
                             f"n_embd {dim}: this implementation runs a core as wide as the prelude only")
        if c.get("recurrent_num_attention_heads") not in (None, heads) or c.get("num_key_value_heads", heads) != heads:
            raise ValueError("config.json asks for grouped-query attention or other heads in the core: this "
                             "implementation runs Parcae with num_attention_heads heads everywhere, as released")
        P, R, C = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"], c["n_layers_in_coda"]
        T, multiple = c["mean_recurrence"], c.get("padding_multiple", 64)
        # value embeddings: a table for every other block, always the last; a gate by the block's
        # layer id, whose coda ids are offset by R * mean_recurrence and whose parity is set by the
        # training depth n_layer = R * mean_backprop_depth (the two rules can disagree)
        n_blocks, n_layer = P + R + C, R * c["mean_backprop_depth"]
        layer_ids = [*range(P + R), *(P + R * T + i for i in range(C))]
        return ModelArgs(
            kind="parcae", dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=dim // heads,
            hidden_dim=c["intermediate_size"], core_hidden_dim=c.get("recurrent_intermediation_embedding_dimension") or 0,
            vocab_size=c.get("padded_vocab_size") or -(-c["vocab_size"] // multiple) * multiple,
            n_prelude=P, n_core=R, n_coda=C, num_steps=T,
            rope_theta=float((c.get("rope_settings") or {}).get("rope_base", 50000)), norm_eps=c.get("norm_eps", 1e-5),
            max_seq_len=c["block_size"], tie_embeddings=bool(c.get("tie_embeddings", True)), qk_bias=False,
            inject=True, norm_each_step=False, post_norm=False, interleaved_rope=True, embed_scale=1.0,
            init_std=math.sqrt(2 / (5 * dim)), injection="diagonal", sandwich=False, qk_norm=bool(c.get("qk_norm", True)),
            gated_mlp=False, prelude_norm=bool(c.get("prelude_norm", True)), coda_in=True,
            ve_tables=tuple(k for k in range(n_blocks) if k % 2 == (n_blocks - 1) % 2),
            ve_gates=tuple(k for k in range(n_blocks) if layer_ids[k] % 2 == (n_layer - 1) % 2))

    @property
    def value_embeds(self):
        """The blocks that mix a value embedding in, in order: the columns of e after the first dim."""
        return sorted(set(self.ve_tables) & set(self.ve_gates))


def rope_table(a: ModelArgs):
    """cos, sin [max_seq_len, head_dim/2], computed in fp32 as both references do."""
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim)
    angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rms_norm(x, weight, eps):
    # statistics in at least fp32, cast back to the input dtype *before* the weight (the references)
    xf = x.float() if x.element_size() < 4 else x
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


def apply_rope(x, cos, sin, interleaved):
    """x [N, heads, hd]; cos, sin [N, hd/2]. Rotates adjacent pairs (interleaved) or the two halves."""
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
    ve_cols: the columns of the value embeddings (P's lookup, R's and C's e) this block mixes into v."""

    def __init__(self, a: ModelArgs, layer_id: int, hidden_dim: int, ve_cols: slice = None):
        super().__init__()
        self.args, self.layer_id = a, layer_id  # layer_id addresses this layer's KV slots in kv.py
        self.qkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, a.n_heads, a.head_dim)) if a.qk_bias else None
        self.proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.fc = nn.Linear(a.dim, (2 if a.gated_mlp else 1) * hidden_dim, bias=False)  # gated: [gate; up]
        self.down = nn.Linear(hidden_dim, a.dim, bias=False)
        norm = lambda: nn.Parameter(torch.ones(a.dim))
        self.attn_norm, self.attn_out_norm = norm(), norm() if a.sandwich else None
        self.mlp_norm, self.mlp_out_norm = norm(), norm() if a.sandwich else None
        self.ve_cols = ve_cols
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, a.n_kv_heads, bias=False) if ve_cols is not None else None

    def forward(self, x, cos, sin, attend, ve=None):  # x [..., N, D]; ve [..., N, columns] when ve_cols
        a = self.args
        h = rms_norm(x, self.attn_norm, a.norm_eps)
        q, k, v = self.qkv(h).split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, a.head_dim)) for t in (q, k, v))  # [..., N, heads, hd]
        if self.ve_gate is not None:  # per kv head, a gate in (0, 2) read from the normed input
            gate = 2 * torch.sigmoid(self.ve_gate(h[..., :VE_GATE_CHANNELS]))
            v = v + gate[..., None] * ve[..., self.ve_cols].unflatten(-1, (-1, a.head_dim))
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_rope(q, cos, sin, a.interleaved_rope), apply_rope(k, cos, sin, a.interleaved_rope)
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
    """Parcae's s <- s * exp(-softplus(dt_bias) * exp(A_log)) + softplus(dt_bias) * (e B^T), per channel.
    The input term depends on the token alone: P makes it once per row (input), R adds it."""

    def __init__(self, dim):
        super().__init__()
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        self.B = nn.Parameter(torch.eye(dim))

    def decay(self):
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def input(self, e):
        return F.softplus(self.dt_bias) * F.linear(e, self.B)


def compile_call(fn, graphs):
    """fn compiled by torch.compile at fixed shapes; with graphs, each call replays a CUDA graph."""
    if graphs:
        return partial(replay, torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead"))
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


def make_room(fn, graphs):
    """Under fullgraph, a compile past dynamo's recompile limit raises: raise the limit, before a
    generation, above the graphs fn has plus those the generation may add. Their number is bounded
    by the calls' shapes (widths, caches, kv.KVCache.span's powers of two, the sampler's filters)."""
    config, n = torch._dynamo.config, len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn))
    config.recompile_limit = max(config.recompile_limit, n + graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, n + graphs)


def replay(graphed, *args):
    """A call of a CUDA-graphed function: its outputs live in memory that the next replay
    overwrites, so the caller gets copies."""
    torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are dead: copied out
    out = graphed(*args)
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


class LoopedLM(nn.Module):
    def __init__(self, a: ModelArgs, config: dict = None, state_init="random", seed=0):
        super().__init__()
        if state_init not in ("random", "zero"):
            raise ValueError(f"state_init must be 'random' or 'zero', not {state_init!r}")
        self.args, self.config = a, config or {}
        self.kind, self.num_steps = a.kind, a.num_steps
        self.state_init, self.seed = state_init, seed
        self.tokenizer = None
        # what load() reads beside the weights: tokenizer_config.json, the chat template, the stop ids
        self.tokenizer_config, self.chat_template = {}, None
        self.eos_token_ids = stop_tokens(self.config, "config.json")
        self._compiled = {}  # function -> its compiled version
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        # value embeddings: one table per mixing block, stacked into one [tables * V, kv width] parameter
        ve_dim, ve_blocks = a.n_kv_heads * a.head_dim, a.value_embeds
        cols = {k: slice(i * ve_dim, (i + 1) * ve_dim) for i, k in enumerate(ve_blocks)}
        block = lambda layer_id, k, hidden: Block(a, layer_id, hidden, cols.get(k))
        # KV layer ids: the looped layers first (one slot per depth each), then prelude and coda;
        # k counts blocks in the checkpoints' order, prelude first
        P, R = a.n_prelude, a.n_core
        self.core = nn.ModuleList(block(j, P + j, a.core_hidden_dim or a.hidden_dim) for j in range(R))
        self.prelude = nn.ModuleList(block(R + i, i, a.hidden_dim) for i in range(P))
        self.coda = nn.ModuleList(block(R + P + i, P + R + i, a.hidden_dim) for i in range(a.n_coda))
        if a.inject:
            self.adapter = DiagonalInjection(a.dim) if a.injection == "diagonal" else nn.Linear(2 * a.dim, a.dim, bias=False)
        else:
            self.adapter = None
        self.norm = nn.Parameter(torch.ones(a.dim))  # Ouro's model.norm, Huginn's and Parcae's ln_f
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.prelude_norm = nn.Parameter(torch.ones(a.dim)) if a.prelude_norm else None
        self.coda_in = nn.Linear(a.dim, a.dim, bias=False) if a.coda_in else None
        self.value_embed = nn.Parameter(torch.zeros(len(ve_blocks) * a.vocab_size, ve_dim)) if ve_blocks else None
        # e: the injection's input, then the value embeddings of the mixing blocks
        self.inject_dim = a.dim + len(ve_blocks) * ve_dim if a.inject else 0
        cos, sin = rope_table(a)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self):
        return self.embed.weight.device

    @property
    def dtype(self):
        return self.embed.weight.dtype

    # -- the three calls --------------------------------------------------------------------------
    # pos: int64 [N] on the host (its max is read without a device sync), -1 for an idle lane; cache:
    # a kv.KVCache, or None for a causal pass over 0..N-1; compiled: the body below runs compiled.

    def P(self, ids, pos, cache=None, compiled=False):
        ids = ids.to(self.device)
        x = self.embed(ids) * self.args.embed_scale  # [N, D]
        if not self.args.inject:
            return None, x
        body = self.compiled(self.p_body) if compiled else self.p_body
        return body(x, self.value_embeddings(ids), *self.to_device(pos, None, cache, compiled)), self.initial_state(pos)

    def R(self, s, e, pos, depth, cache=None, compiled=False):
        """One recurrence for every row; idle lanes keep their state. depth: an int (all rows alike)
        or an int64 tensor, per row."""
        body = self.compiled(self.r_body) if compiled else self.r_body
        return body(s, e, *self.to_device(pos, depth, cache, compiled))

    def C(self, s, e, pos, cache=None, rows=None):
        """Logits (float32) for `rows` of the batch (default all). The coda runs on every row, since
        it writes coda KV that later positions read. (Compiled decoding compiles c_body together with
        the choice of tokens: wfd.read_body.)"""
        return self.c_body(s, e, *self.to_device(pos, None, cache), rows)

    def to_device(self, pos, depth, cache, compiled=False):
        """A call's host inputs, checked against the cache and moved to the device, and the key
        blocks its attention reads (kv.KVCache.span; bucketed when compiled, for a bounded graph count)."""
        span = None if cache is None else cache.span(pos, bucket=compiled)
        move = lambda t: t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t
        return move(pos), move(depth), cache, span

    def p_body(self, x, ve, pos, depth, cache, span):
        x = self._layers(self.prelude, x, pos, depth, cache, span, ve)
        if self.prelude_norm is not None:
            x = rms_norm(x, self.prelude_norm, self.args.norm_eps)
        e = self.adapter.input(x) if self.args.injection == "diagonal" else x
        return e if ve is None else torch.cat([e, ve], dim=-1)

    def r_body(self, s, e, pos, depth, cache, span):
        x = self.inject(s, e) if self.args.inject else s
        x = self._layers(self.core, x, pos, depth, cache, span, self.stored_value_embeddings(e))
        x = rms_norm(x, self.norm, self.args.norm_eps) if self.args.norm_each_step else x
        return torch.where(pos[:, None] >= 0, x, s)

    def c_body(self, s, e, pos, depth, cache, span, rows=None):
        a = self.args
        if self.coda_in is not None:
            s = self.coda_in(s)
        if a.norm_before_coda:
            s = rms_norm(s, self.norm, a.norm_eps)
        if self.coda:
            s = self._layers(self.coda, s, pos, depth, cache, span, self.stored_value_embeddings(e))
        if not a.norm_each_step:  # the final norm after the coda, not after each recurrence
            s = rms_norm(s, self.norm, a.norm_eps)
        return self.lm_head(s if rows is None else s[rows]).float()  # [rows, V]

    def inject(self, s, e):
        """The core's input at a recurrence: [N, D]."""
        if self.args.injection == "diagonal":
            return s * self.adapter.decay() + e[..., :self.args.dim]
        return self.adapter(torch.cat([s, e], dim=-1))  # [N, 2D] -> [N, D]

    def value_embeddings(self, ids):
        """The mixing blocks' value embeddings of the tokens, [N, tables * kv width], or None."""
        if self.value_embed is None:
            return None
        tables = self.value_embed.shape[0] // self.args.vocab_size
        offsets = torch.arange(tables, device=ids.device) * self.args.vocab_size
        return F.embedding(ids[:, None] + offsets, self.value_embed).flatten(1)

    def stored_value_embeddings(self, e):
        return None if self.value_embed is None else e[..., self.args.dim:]

    def _layers(self, blocks, x, pos, depth, cache, span, ve=None):
        # RoPE rows, KV columns and masks: built once per call, not once per layer
        p = pos.clamp(min=0)  # idle lanes (-1) take any RoPE row
        cos, sin = self.rope_cos.index_select(0, p), self.rope_sin.index_select(0, p)
        step = None if cache is None else cache.prepare(pos, depth, span)
        for blk in blocks:
            attend = causal_attention if step is None else partial(cache.attend, step, blk.layer_id)
            x = blk(x, cos, sin, attend, ve)
        return x

    def compiled(self, fn, room=0):
        """fn, device work of this model, compiled once for every later generation (README, "Compiled
        decoding"): on CUDA a CUDA graph per shape, on a CPU a C++ wrapper (quicker to enter)."""
        if fn not in self._compiled:
            self._compiled[fn] = compile_call(fn, graphs=self.device.type == "cuda")
        if room:  # graphs fn may still add in the caller's generation
            make_room(fn, room)
        return self._compiled[fn]

    def initial_state(self, pos):
        """Huginn's and Parcae's s0. "random" draws the like-init distribution (truncated normal at
        +-3 sigma, times the embedding scale) from a generator seeded by (seed, position), so a position
        gets the same s0 however often and by whichever schedule it is computed."""
        a = self.args
        if self.state_init == "zero":
            return torch.zeros(len(pos), a.dim, device=self.device, dtype=self.dtype)
        rows = []
        for p in pos.tolist():
            key = hashlib.blake2b(f"{self.seed},{p}".encode(), digest_size=4).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key, "little"))  # CPU generators keep 32 bits
            rows.append(nn.init.trunc_normal_(torch.empty(a.dim), std=a.init_std, a=-3 * a.init_std,
                                              b=3 * a.init_std, generator=g))
        return (torch.stack(rows) * a.embed_scale).to(self.device, self.dtype)

    # -- full-sequence forward --------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids, num_steps=None, state=None):
        """Logits [N, V] (float32) after `num_steps` recurrences over the whole sequence, no cache.
        Huginn and Parcae start from the model's initial state, or from `state` [N, D] when given."""
        ids = torch.as_tensor(ids).reshape(-1)
        if len(ids) > self.args.max_seq_len:
            raise ValueError(f"{len(ids)} positions exceed the model's context of {self.args.max_seq_len}")
        pos = torch.arange(len(ids))
        e, s = self.P(ids, pos)
        if state is not None:
            if not self.args.inject:
                raise ValueError("an explicit initial state is only defined for Huginn and Parcae")
            state = torch.as_tensor(state).reshape(-1, self.args.dim) if state.numel() else state
            if tuple(state.shape) != (len(ids), self.args.dim):
                raise ValueError(f"state has shape {tuple(state.shape)}, expected {(len(ids), self.args.dim)}")
            s = state.to(self.device, self.dtype)
        for d in range(self.num_steps if num_steps is None else num_steps):
            s = self.R(s, e, pos, d)
        return self.C(s, e, pos)


def set_threads(model, threads=None):
    """`threads` CPU threads, or one for a model under 100M parameters: its matmuls are too small to
    gain from more, and lose a lot when another process holds a core."""
    if threads or sum(p.numel() for p in model.parameters()) < 100e6:
        torch.set_num_threads(threads or 1)


def from_config(config: dict, device="cpu", dtype=torch.float32, state_init="random", seed=0, init_seed=None):
    """A model of this config. With init_seed, random weights (for tests and timing at real sizes);
    without, uninitialised memory that load() fills."""
    check_device(device)
    a = ModelArgs.from_config(config)
    with torch.device("meta"):
        model = LoopedLM(a, config, state_init, seed)
    check_fits(model, torch.device(device), dtype)
    # every tensor allocated once, in its dtype on its device: float32 first and a cast after would
    # hold both (15 GB for Huginn in bfloat16)
    model = model.to(dtype).to_empty(device=device)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_table(a))  # fp32 whatever the dtype
    if a.tie_embeddings:  # to_empty() gives every parameter its own storage
        model.lm_head.weight = model.embed.weight
    if init_seed is not None:
        g = torch.Generator().manual_seed(init_seed)
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                w = 1 + 0.2 * (torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith("qk_bias"):
                w = 0.3 * torch.randn(p.shape, generator=g)
            else:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.data.copy_(w)
    return model.eval().requires_grad_(False)


def check_fits(model, device, dtype):
    """Refuse, before anything is allocated, weights that do not fit in the device's free memory."""
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free = free_memory(device)
    if free is not None and need > free:
        raise ValueError(f"the weights need {need / 2**30:.2f} GiB in {str(dtype).replace('torch.', '')}, but "
                         f"{device} has {free / 2**30:.2f} GiB free: try a smaller dtype (--dtype bfloat16 "
                         "halves float32), or a device with more memory")


def check_device(device):
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has no CUDA or sees no GPU; "
                         "use the CPU")
