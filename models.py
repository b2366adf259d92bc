"""Ouro and Huginn, two looped LMs, read from raw safetensors and driven through three calls.

    P(ids, pos)               -> (e, s0)  embed the tokens (Huginn: and run the prelude); initial state
    R(s, e, pos, depth)       -> s        one recurrence of the weight-shared block, for rows that may
                                          sit at different positions and different depths
    C(s, pos)                 -> logits   read a state out (Huginn: ln_f, coda, ln_f; then lm_head)

                      Ouro (Ouro-1.4B/2.6B)                  Huginn (huginn-0125)
    P                 s0 = embed(ids); no injection          e = prelude(embed(ids) * sqrt(D)); s0 = zero/random
    R                 s = norm(layers(s))                    s = core(adapter(concat(s, e)))
    C                 lm_head(s)                             lm_head(ln_f(coda(ln_f(s))))

A row is one token position at one depth (completed recurrences). Every recurrent layer applied at
depth d reads and writes KV slot d, so rows at different depths can share one batched R call: the
matmuls see a plain [rows, D] batch, and only attention cares which depth a row is at (kv.py).
"""
import hashlib
import json
import math
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kv import causal_attention

SUPPORTED = {"ouro": "Ouro (ByteDance/Ouro-1.4B, Ouro-2.6B)", "huginn_raven": "Huginn (tomg-group-umd/huginn-0125)"}
UNSUPPORTED = {
    "ouro": {"rope_scaling": lambda v: v is None, "use_sliding_window": lambda v: not v,
             "hidden_act": lambda v: v == "silu"},
    "huginn_raven": {"injection_type": lambda v: v == "linear", "nonlin_name": lambda v: v == "SiLU",
                     "bias": lambda v: not v, "test_time_noise": lambda v: not v},
}


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
    embed_scale: float     # Huginn: sqrt(D); Ouro: 1
    init_std: float = 0.0  # Huginn: sigma of the "like-init" random initial state

    @staticmethod
    def from_config(c: dict) -> "ModelArgs":
        model_type = c.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"unknown model_type {model_type!r} in config.json; supported: "
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
                init_std=(c.get("init_values") or {}).get("std", math.sqrt(2 / (5 * dim))))


def rope_table(a: ModelArgs):
    """cos, sin [max_seq_len, head_dim/2], computed in fp32 as both references do."""
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim)
    angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rms_norm(x, weight, eps):
    # statistics in at least fp32, cast back to the input dtype *before* the weight (both references)
    xf = x.float() if x.element_size() < 4 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


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
    """One transformer layer with four RMSNorms: on the attention's input and output, on the MLP's
    input and output (the output ones before or after the residual add: ModelArgs.post_norm)."""

    def __init__(self, a: ModelArgs, layer_id: int):
        super().__init__()
        self.args, self.layer_id = a, layer_id  # layer_id addresses this layer's KV slots in kv.py
        self.qkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, a.n_heads, a.head_dim)) if a.qk_bias else None
        self.proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.fc = nn.Linear(a.dim, 2 * a.hidden_dim, bias=False)  # [gate; up]
        self.down = nn.Linear(a.hidden_dim, a.dim, bias=False)
        self.attn_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm = (
            nn.Parameter(torch.ones(a.dim)) for _ in range(4))

    def forward(self, x, cos, sin, attend):  # x [..., N, D]
        a = self.args
        q, k, v = self.qkv(rms_norm(x, self.attn_norm, a.norm_eps)).split(
            [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, a.head_dim)) for t in (q, k, v))  # [..., N, heads, hd]
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_rope(q, cos, sin, a.interleaved_rope), apply_rope(k, cos, sin, a.interleaved_rope)
        x = self.residual(x, self.proj(attend(q, k, v).flatten(-2)), self.attn_out_norm)
        gate, up = self.fc(rms_norm(x, self.mlp_norm, a.norm_eps)).chunk(2, dim=-1)
        return self.residual(x, self.down(F.silu(gate) * up), self.mlp_out_norm)

    def residual(self, x, h, norm):
        if self.args.post_norm:
            return rms_norm(h + x, norm, self.args.norm_eps)
        return x + rms_norm(h, norm, self.args.norm_eps)


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
        # KV layer ids: the looped layers first (one slot per depth each), then prelude and coda
        self.core = nn.ModuleList(Block(a, j) for j in range(a.n_core))
        self.prelude = nn.ModuleList(Block(a, a.n_core + i) for i in range(a.n_prelude))
        self.coda = nn.ModuleList(Block(a, a.n_core + a.n_prelude + i) for i in range(a.n_coda))
        self.adapter = nn.Linear(2 * a.dim, a.dim, bias=False) if a.inject else None
        self.norm = nn.Parameter(torch.ones(a.dim))  # Ouro's model.norm, Huginn's ln_f
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
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
        x = self.embed(ids.to(self.device)) * self.args.embed_scale  # [N, D]
        if not self.args.inject:
            return None, x
        body = self.compiled(self.p_body) if compiled else self.p_body
        return body(x, *self.to_device(pos, None, cache, compiled)), self.initial_state(pos)

    def R(self, s, e, pos, depth, cache=None, compiled=False):
        """One recurrence for every row; idle lanes keep their state. depth: an int (all rows alike)
        or an int64 tensor, per row."""
        body = self.compiled(self.r_body) if compiled else self.r_body
        return body(s, e, *self.to_device(pos, depth, cache, compiled))

    def C(self, s, pos, cache=None, rows=None):
        """Logits (float32) for `rows` of the batch (default all). Huginn's coda runs on every row,
        since it writes coda KV that later positions read. (Compiled decoding compiles c_body together
        with the choice of tokens: wfd.read_body.)"""
        return self.c_body(s, *self.to_device(pos, None, cache), rows)

    def to_device(self, pos, depth, cache, compiled=False):
        """A call's host inputs, checked against the cache and moved to the device, and the key
        blocks its attention reads (kv.KVCache.span; bucketed when compiled, for a bounded graph count)."""
        span = None if cache is None else cache.span(pos, bucket=compiled)
        move = lambda t: t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t
        return move(pos), move(depth), cache, span

    def p_body(self, x, pos, depth, cache, span):
        return self._layers(self.prelude, x, pos, depth, cache, span)

    def r_body(self, s, e, pos, depth, cache, span):
        x = self.adapter(torch.cat([s, e], dim=-1)) if self.args.inject else s  # [N, 2D] -> [N, D]
        x = self._layers(self.core, x, pos, depth, cache, span)
        x = rms_norm(x, self.norm, self.args.norm_eps) if self.args.norm_each_step else x
        return torch.where(pos[:, None] >= 0, x, s)

    def c_body(self, s, pos, depth, cache, span, rows=None):
        if not self.args.norm_each_step:  # the final norm sits around the coda instead
            eps = self.args.norm_eps
            s = rms_norm(self._layers(self.coda, rms_norm(s, self.norm, eps), pos, depth, cache, span),
                         self.norm, eps)
        return self.lm_head(s if rows is None else s[rows]).float()  # [rows, V]

    def _layers(self, blocks, x, pos, depth, cache, span):
        # RoPE rows, KV columns and masks: built once per call, not once per layer
        p = pos.clamp(min=0)  # idle lanes (-1) take any RoPE row
        cos, sin = self.rope_cos.index_select(0, p), self.rope_sin.index_select(0, p)
        step = None if cache is None else cache.prepare(pos, depth, span)
        for blk in blocks:
            attend = causal_attention if step is None else partial(cache.attend, step, blk.layer_id)
            x = blk(x, cos, sin, attend)
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
        """Huginn's s0. "random" draws the like-init distribution (truncated normal at +-3 sigma,
        times sqrt(D)) from a generator seeded by (seed, position), so a position gets the same s0
        however often and by whichever schedule it is computed."""
        a = self.args
        if self.state_init == "zero":
            return torch.zeros(len(pos), a.dim, device=self.device, dtype=self.dtype)
        rows = []
        for p in pos.tolist():
            key = hashlib.blake2b(f"{self.seed},{p}".encode(), digest_size=4).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key, "little"))  # CPU generators keep 32 bits
            rows.append(nn.init.trunc_normal_(torch.empty(a.dim), std=a.init_std, a=-3 * a.init_std,
                                              b=3 * a.init_std, generator=g))
        return (torch.stack(rows) * math.sqrt(a.dim)).to(self.device, self.dtype)

    # -- full-sequence forward --------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids, num_steps=None, state=None):
        """Logits [N, V] (float32) after `num_steps` recurrences over the whole sequence, no cache.
        Huginn starts from the model's initial state, or from `state` [N, D] when given."""
        ids = torch.as_tensor(ids).reshape(-1)
        if len(ids) > self.args.max_seq_len:
            raise ValueError(f"{len(ids)} positions exceed the model's context of {self.args.max_seq_len}")
        pos = torch.arange(len(ids))
        e, s = self.P(ids, pos)
        if state is not None:
            if not self.args.inject:
                raise ValueError("an explicit initial state is only defined for Huginn")
            state = torch.as_tensor(state).reshape(-1, self.args.dim) if state.numel() else state
            if tuple(state.shape) != (len(ids), self.args.dim):
                raise ValueError(f"state has shape {tuple(state.shape)}, expected {(len(ids), self.args.dim)}")
            s = state.to(self.device, self.dtype)
        for d in range(self.num_steps if num_steps is None else num_steps):
            s = self.R(s, e, pos, d)
        return self.C(s, pos)


def set_threads(model, threads=None):
    """`threads` CPU threads, or one for a model under 100M parameters: its matmuls are too small to
    gain from more, and lose a lot when another process holds a core."""
    if threads or sum(p.numel() for p in model.parameters()) < 100e6:
        torch.set_num_threads(threads or 1)


# -- checkpoints ------------------------------------------------------------------------------------

NORMS = ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")  # Block's, in the checkpoints' order


def checkpoint_layout(a: ModelArgs):
    """Our parameter name -> [(checkpoint key, rows)]: fused parameters are concatenations of
    several checkpoint tensors along dim 0. Also returns the checkpoint keys we read but do not use."""
    qkv = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
    layout = {}
    if a.kind == "ouro":
        for i in range(a.n_core):
            src, dst = f"model.layers.{i}.", f"core.{i}."
            layout[dst + "qkv.weight"] = [(src + f"self_attn.{n}_proj.weight", r) for n, r in zip("qkv", qkv)]
            layout[dst + "proj.weight"] = [(src + "self_attn.o_proj.weight", None)]
            layout[dst + "fc.weight"] = [(src + "mlp.gate_proj.weight", a.hidden_dim),
                                         (src + "mlp.up_proj.weight", a.hidden_dim)]
            layout[dst + "down.weight"] = [(src + "mlp.down_proj.weight", None)]
            for ours, theirs in zip(NORMS, ["input_layernorm", "input_layernorm_2",
                                            "post_attention_layernorm", "post_attention_layernorm_2"]):
                layout[dst + ours] = [(src + theirs + ".weight", None)]
        layout["embed.weight"] = [("model.embed_tokens.weight", None)]
        layout["norm"] = [("model.norm.weight", None)]
        unused = {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}  # always full depth
    else:
        for group, src_group, n_layers in (("prelude", "prelude", a.n_prelude), ("core", "core_block", a.n_core),
                                           ("coda", "coda", a.n_coda)):
            for i in range(n_layers):
                src, dst = f"transformer.{src_group}.{i}.", f"{group}.{i}."
                layout[dst + "qkv.weight"] = [(src + "attn.Wqkv.weight", None)]
                layout[dst + "proj.weight"] = [(src + "attn.proj.weight", None)]
                layout[dst + "fc.weight"] = [(src + "mlp.fc.weight", None)]
                layout[dst + "down.weight"] = [(src + "mlp.proj.weight", None)]
                if a.qk_bias:
                    layout[dst + "qk_bias"] = [(src + "attn.qk_bias", None)]
                for n, ours in enumerate(NORMS, 1):
                    layout[dst + ours] = [(src + f"norm_{n}.weight", None)]
        layout["embed.weight"] = [("transformer.wte.weight", None)]
        layout["adapter.weight"] = [("transformer.adapter.weight", None)]
        layout["norm"] = [("transformer.ln_f.weight", None)]
        # the hub stores the tied head a second time, and its RoPE table (read separately below)
        unused = {"lm_head.weight"} if a.tie_embeddings else set()
    if not a.tie_embeddings:
        layout["lm_head.weight"] = [("lm_head.weight", None)]
    return layout, unused


def from_config(config: dict, device="cpu", dtype=torch.float32, state_init="random", seed=0, init_seed=None):
    """A model of this config. With init_seed, random weights (for tests and timing at real sizes);
    without, uninitialised memory that load() fills."""
    check_device(device)
    a = ModelArgs.from_config(config)
    with torch.device("meta"):
        model = LoopedLM(a, config, state_init, seed)
    # every tensor allocated once, in its dtype on its device: float32 first and a cast after would
    # hold both (15 GB for Huginn in bfloat16)
    model = model.to(dtype).to_empty(device=device)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_table(a))  # fp32 whatever the dtype
    if a.tie_embeddings:  # to_empty() gives every parameter its own storage
        model.lm_head.weight = model.embed.weight
    if init_seed is not None:
        g = torch.Generator().manual_seed(init_seed)
        for name, p in model.named_parameters():
            if name.endswith(("norm",) + NORMS):
                w = 1 + 0.2 * (torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith("qk_bias"):
                w = 0.3 * torch.randn(p.shape, generator=g)
            else:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.data.copy_(w)
    return model.eval().requires_grad_(False)


HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def check_device(device):
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has no CUDA or sees no GPU; "
                         "use the CPU")


def resolve(source):
    """A local folder, or a hub id fetched with huggingface_hub (config, weights, tokenizer only).
    A name that can only be a path (./x, /x, ~/x, a/b/c) is never sent to the hub."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"{source} is a file, not a model folder (one holding config.json and *.safetensors)")
    if not re.fullmatch(r"\w[\w.-]*(/\w[\w.-]*)?", source):
        raise FileNotFoundError(f"no such model folder: {source}")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(source, allow_patterns=HUB_FILES)
    except Exception as err:
        raise ConnectionError(
            f"could not get {source!r} from the Hugging Face hub ({type(err).__name__}: {err}), and there is "
            "no local folder of that name. The hub is unreachable from here or the id is wrong; download "
            "the model on a machine that can reach it and pass its local folder instead") from err


def read_json(path):
    """A JSON object from a file, the file named when it holds anything else."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except ValueError as err:  # also the UnicodeDecodeError of a binary file
            raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    return obj


def stop_tokens(config, path):
    """A config's eos_token_id (absent, an id, or a list of ids: real checkpoints end a text and a
    turn with different tokens) as a tuple."""
    eos = config.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of token ids, not {eos!r}")
    return tuple(ids)


def read_chat_files(model, folder):
    """tokenizer_config.json, the chat template (chat_template.jinja where the checkpoint has one, as
    Hugging Face reads it, else tokenizer_config.json's) and the stop ids (generation_config.json's,
    else config.json's), onto the model."""
    path = os.path.join(folder, "tokenizer_config.json")
    model.tokenizer_config = read_json(path) if os.path.exists(path) else {}
    template = model.tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            template = f.read()
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}: the chat template is not a string")
    model.chat_template = template
    path = os.path.join(folder, "generation_config.json")
    generation = read_json(path) if os.path.exists(path) else {}
    if "eos_token_id" in generation:
        model.eos_token_ids = stop_tokens(generation, path)


def load(source, device="cpu", dtype=None, state_init="random", seed=0):
    """Load an Ouro or Huginn checkpoint from a folder or hub id, tensor by tensor (a 3.5B model is
    never in memory twice). dtype defaults to the checkpoint's. Every tensor is checked to be finite:
    damaged weights would otherwise decode to garbage (argmax of NaN logits is token 0)."""
    check_device(device)
    folder = resolve(source)
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {folder}")
    config = read_json(config_path)
    a = ModelArgs.from_config(config)
    files = _weight_files(folder)
    key_file = {}
    for path in files:
        with _open(path) as f:
            key_file.update((k, path) for k in f.keys())
    layout, unused = checkpoint_layout(a)
    if dtype is None:
        embed_key = layout["embed.weight"][0][0]
        dtype = _read(key_file, embed_key).dtype if embed_key in key_file else torch.float32
    model = from_config(config, device, dtype, state_init, seed)
    read_chat_files(model, folder)  # before the weights: a damaged file is named in seconds
    expected = {k for parts in layout.values() for k, _ in parts} | unused | (
        {"freqs_cis"} if a.kind == "huginn" else set())
    missing = sorted(expected - unused - key_file.keys())
    if missing:
        raise ValueError(f"checkpoint {folder} lacks tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(key_file.keys() - expected)
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in {folder} for a {config['model_type']} "
                         f"model of this config" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    params = dict(model.named_parameters())
    big = sum(os.path.getsize(path) for path in files) > 1e9  # worth a progress bar (on a terminal)
    for name, parts in tqdm(layout.items(), desc=f"loading {folder}", unit="tensor", file=sys.stderr,
                            disable=None if big else True):
        p, row = params[name], 0
        for key, rows in parts:
            want = (rows or p.shape[0],) + tuple(p.shape[1:])
            t = _read(key_file, key)
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)}, expected {want}")
            p.data[row:row + want[0]].copy_(t)
            row += want[0]
    if a.kind == "huginn":  # the stored RoPE table is what the reference uses: cos [..., 0], sin [..., 1]
        t = _read(key_file, "freqs_cis")
        want = (1, a.max_seq_len, 1, a.head_dim // 2, 2)
        if tuple(t.shape) != want:
            raise ValueError(f"tensor 'freqs_cis' has shape {tuple(t.shape)}, expected {want}")
        model.rope_cos, model.rope_sin = (t[0, :, 0, :, i].float().to(device) for i in (0, 1))
    tok_path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer
        try:
            model.tokenizer = Tokenizer.from_file(tok_path)
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{tok_path} is not a tokenizer.json that tokenizers can read: {err}") from None
    return model


def _weight_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    paths = [os.path.join(folder, n) for n in names]
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"weight file {path} named by the index is missing")
    return paths


@contextmanager
def _open(path):
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or damaged?): {err}") from None


def _read(key_file, key):
    with _open(key_file[key]) as f:
        t = f.get_tensor(key)
    if not torch.isfinite(t).all():
        raise ValueError(f"tensor {key!r} in {key_file[key]} holds NaN or inf: the weights are damaged")
    return t


def save(model: LoopedLM, folder):
    """Write config.json and model.safetensors in the official layout (what load() reads)."""
    os.makedirs(folder, exist_ok=True)
    layout, _ = checkpoint_layout(model.args)
    params, tensors = dict(model.named_parameters()), {}
    for name, parts in layout.items():
        p, row = params[name].detach(), 0
        for key, rows in parts:
            tensors[key] = p[row:row + (rows or p.shape[0])].contiguous().cpu()
            row += rows or p.shape[0]
    if model.kind == "ouro":  # the official code requires the (unused) exit gate
        tensors["model.early_exit_gate.weight"] = torch.zeros(1, model.args.dim, dtype=model.dtype)
        tensors["model.early_exit_gate.bias"] = torch.zeros(1, dtype=model.dtype)
    else:
        tensors["freqs_cis"] = torch.stack([model.rope_cos, model.rope_sin], -1)[None, :, None]
        if model.args.tie_embeddings:
            tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config, f, indent=2)
