"""Five families of looped LMs, driven through three calls (their configs and checkpoints are read
in formats/, their transformer layer is layers/transformer.py):

    P(ids, pos)          -> (s0, e)  the initial state; e, the tokens embedded (through the prelude)
    R(s, e, pos, depth)  -> s        one recurrence of the weight-shared block, for rows that may
                                     sit at different positions and different depths
    C(s, e, pos)         -> logits   read a state out

    Ouro        P: s0 = embed(ids)
                R: s = norm(layers(s))               C: lm_head(s)
    Huginn      P: e = prelude(embed(ids) * sqrt(D)); s0 = zero or random
                R: s = core(adapter(concat(s, e)))   C: lm_head(ln_f(coda(ln_f(s))))
    Parcae      P: x = ln_prelude(prelude(embed(ids))); e = [softplus(dt) * (x B^T), ve]; s0
                R: s = core(s * decay + e)           C: lm_head(ln_f(coda(s C^T)))
    LoopFormer  P: s0 = embed(ids) + pos_embed(pos)
                R: s = layers(s), each block modulated by the clock (d / T, 1 / T) of the row's
                   depth d                           C: lm_head(norm(s)), the head tied
    Raven       a pretrained Llama or OLMo-2 made looped: P and R as Huginn's, in Llama or OLMo-2
    retrofits   blocks (no embedding scale)         C: lm_head(ln_f(coda(s))), the head untied

e holds what a row's recurrences and read need of its token besides the state, made once by P and
kept with the row's state (wfd.Loop): Huginn's prelude output; Parcae's injection term and the
token's value embeddings (tables looked up by token id that some blocks mix into v, in every
recurrence).
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from formats import checkpoints, configs, devices
from layers.noise import mix32, seed_key, truncated_normal
from layers.transformer import (Block, Clock, DiagonalInjection, causal_attention, rms_norm,
                                rope_table)

S0_STREAM = 0x85EBCA6B  # keeps the initial state's noise apart from sampling's for the same seed


# A first read can skip to LoopedLM.P (the three calls): ModelArgs, the model's parts and loading
# are the families' plumbing.
@dataclass
class ModelArgs:
    """What a family is, decided here once so that the forward code has no branches (filled from
    config.json by formats/configs.py). Three groups: every family's sizes; the flags in which Ouro
    and Huginn, the paper's two families, differ; then flags whose defaults are Ouro's and Huginn's,
    which only the other three families set (a reader of Ouro and Huginn can skip them):

        Parcae           injection="diagonal", sandwich=False, qk_norm, mlp="relu2",
                         core_hidden_dim, prelude_norm, coda_in, ve_tables, ve_gates
        LoopFormer       sandwich=False, norm_weights=False, rope=False, mlp="gelu", pos_embed,
                         clock, config_stop_ids=False
        Llama retrofit   sandwich=False, rope_scaling (Llama-3's), config_stop_ids=False
        OLMo-2 retrofit  in_norm=False, qk_proj_norm, config_stop_ids=False
    """
    # -- every family: the sizes -------------------------------------------------------------------
    kind: str              # "ouro", "huginn", "parcae", "loopformer" or "retrofit"
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int        # SwiGLU width
    vocab_size: int
    n_prelude: int         # layers run once per token before the loop; 0 for Ouro
    n_core: int            # the looped layers
    n_coda: int            # layers after the loop, run at each C call; 0 for Ouro
    num_steps: int         # default full depth T
    rope_theta: float
    norm_eps: float        # None: nn.RMSNorm's default, its arithmetic's epsilon (LoopFormer)
    max_seq_len: int       # length of the RoPE table: the model's context
    tie_embeddings: bool
    # -- Ouro and Huginn ---------------------------------------------------------------------------
    inject: bool           # Huginn: P runs a prelude whose output e every recurrence reads through
                           # an adapter, and s0 is a fresh latent; Ouro: s0 is the embedding
    norm_each_step: bool   # Ouro: the final norm after every recurrence; Huginn: around the coda
    post_norm: bool        # Huginn: norm(x + f(x)); Ouro: x + norm(f(x))
    interleaved_rope: bool # Huginn rotates adjacent pairs, Ouro the two halves
    embed_scale: float     # Huginn: sqrt(D); Ouro: 1
    qk_bias: bool = False  # Huginn: learned bias on q and k, added before RoPE
    init_std: float = 0.0  # Huginn: sigma of the "like-init" initial state (x embed_scale)
    norm_before_coda: bool = False  # Huginn: ln_f on the state before the coda too
    # -- Parcae, LoopFormer and the retrofits only (the table above) -------------------------------
    injection: str = "adapter"      # how R reads e: an adapter of concat(s, e), or "diagonal"
    sandwich: bool = True           # norms on the sub-layers' outputs too (else inputs only)
    in_norm: bool = True            # norms on the sub-layers' inputs
    norm_weights: bool = True       # False: the blocks' norms have no weight
    qk_norm: bool = False           # a weightless RMS norm on q and k, after RoPE
    qk_proj_norm: bool = False      # weighted norms of the q and k projections
    rope: bool = True               # False: no RoPE (P adds learned positions)
    rope_scaling: tuple = None      # Llama-3's (factor, low, high, original context)
    mlp: str = "swiglu"             # layers.transformer.MLPS
    pos_embed: bool = False         # learned positions, added by P
    clock: bool = False             # each block modulated by its row's clock
    config_stop_ids: bool = True    # False: the configs' eos ids are absent or stale: load takes
                                    # the tokenizer's
    core_hidden_dim: int = 0        # MLP width of the looped layers, when not hidden_dim
    prelude_norm: bool = False      # ln_prelude on the prelude's output
    coda_in: bool = False           # the linear map C of the final state into the coda
    # value embeddings, by block (0.. over prelude, core, coda): the blocks whose table the
    # checkpoint holds, and those with a gate; a block mixes one in where it has both
    ve_tables: tuple = ()
    ve_gates: tuple = ()

    @staticmethod
    def from_config(c: dict, keys=None) -> "ModelArgs":
        """keys: the checkpoint's tensor names, where known (formats.configs.raven_layout)."""
        return ModelArgs(**configs.model_args(c, keys))

    @property
    def value_embeds(self):
        """The blocks that mix a value embedding in, in order: e's columns after the first D."""
        return sorted(set(self.ve_tables) & set(self.ve_gates))


class Call(NamedTuple):
    """What a P / R / C body reads besides the rows' data, on the model's device. The engine passes
    a Call of its own (engine/model_runner.py) with these fields and more, for its lanes."""
    pos: torch.Tensor                # [N] the rows' positions
    depth: Optional[torch.Tensor]    # [N] their depths (R); None in P and C, which run no looped
                                     # layer
    cache: object = None             # kv.KVCache (prepare, attend); None: causal over 0..N-1
    clock: Optional[torch.Tensor] = None  # LoopFormer: the blocks' modulation per depth


class LoopedLM(nn.Module):
    def __init__(self, a: ModelArgs, config: dict = None, state_init="random", seed=0):
        super().__init__()
        if state_init not in ("random", "zero"):
            raise ValueError(f"state_init must be 'random' or 'zero', not {state_init!r}")
        self.args, self.config = a, config or {}
        self.kind, self.num_steps = a.kind, a.num_steps
        self.state_init, self.seed = state_init, seed
        self.s0_key = mix32(seed_key(seed) ^ S0_STREAM)  # initial_state's noise
        self.tokenizer = None
        # what load() reads beside the weights: tokenizer_config.json, chat template, stop ids
        self.tokenizer_config, self.chat_template = {}, None
        stop = checkpoints.stop_tokens(self.config, "config.json")
        self.eos_token_ids = stop if a.config_stop_ids else ()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        # value embeddings: one table per mixing block, stacked into one [tables * V, kv width]
        ve_dim, ve_blocks = a.n_kv_heads * a.head_dim, a.value_embeds
        cols = {b: slice(i * ve_dim, (i + 1) * ve_dim) for i, b in enumerate(ve_blocks)}
        block = lambda layer_id, index, hidden: Block(a, layer_id, hidden, cols.get(index))
        # KV layer ids: the looped layers first (one slot per depth each), then prelude and coda;
        # index: the block's place in the checkpoints' order, prelude first
        n_pre, n_core = a.n_prelude, a.n_core
        core_hidden = a.core_hidden_dim or a.hidden_dim
        self.core = nn.ModuleList(block(j, n_pre + j, core_hidden) for j in range(n_core))
        self.prelude = nn.ModuleList(block(n_core + i, i, a.hidden_dim) for i in range(n_pre))
        self.coda = nn.ModuleList(block(n_core + n_pre + i, n_pre + n_core + i, a.hidden_dim)
                                  for i in range(a.n_coda))
        diagonal = a.injection == "diagonal"
        self.adapter = None if not a.inject else (
            DiagonalInjection(a.dim) if diagonal else nn.Linear(2 * a.dim, a.dim, bias=False))
        self.norm = nn.Parameter(torch.ones(a.dim))  # Ouro's model.norm, Huginn's and Parcae's ln_f
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.prelude_norm = nn.Parameter(torch.ones(a.dim)) if a.prelude_norm else None
        self.coda_in = nn.Linear(a.dim, a.dim, bias=False) if a.coda_in else None
        self.value_embed = (nn.Parameter(torch.zeros(len(ve_blocks) * a.vocab_size, ve_dim))
                            if ve_blocks else None)
        # e: the injection's input, then the value embeddings of the mixing blocks
        self.inject_dim = a.dim + len(ve_blocks) * ve_dim if a.inject else 0
        self.pos_embed = nn.Embedding(a.max_seq_len, a.dim) if a.pos_embed else None
        self.clock = Clock(a.dim) if a.clock else None
        self.clock_tables = {}  # LoopFormer: (T, dtype, device) -> clock_table(T)
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
    # pos: int64 [N] on the model's device; depth: int64 [N], each row's, or an int for all (R);
    # cache: a kv.KVCache, or None for a causal pass over 0..N-1. Each wraps a body (p_body, r_body,
    # c_state and head: the device work, which the engine calls with Calls of its own). R's path,
    # r_body -> _layers, is the method's; the rest of the bodies is the families' plumbing.

    def P(self, ids, pos, cache=None):
        """Start rows: (s0, e), their initial state and e (e None where R reads no e: Ouro,
        LoopFormer), in the order wfd.Loop keeps them per row and R and C take."""
        return self.p_body(ids, Call(pos, None, cache))

    def R(self, s, e, pos, depth, cache=None, num_steps=None):
        """One recurrence for every row, each at its own depth (which only attention and
        LoopFormer's clock read). r_body: e injected (Huginn, Parcae), then `_layers` runs the
        core's blocks over the [N, D] batch, then Ouro's norm. num_steps: the full depth T of the
        schedule the rows follow (default: the cache's, else the model's): LoopFormer's clock."""
        clock = None
        if self.clock is not None:
            clock = self.clock_table(num_steps or getattr(cache, "num_steps", self.num_steps))
        depth = torch.full_like(pos, depth) if isinstance(depth, int) else depth
        return self.r_body(s, e, Call(pos, depth, cache, clock))

    def C(self, s, e, pos, cache=None):
        """Logits (float32) of every row. The coda runs on every row, since it writes coda KV
        that later positions read."""
        return self.head(self.c_state(s, e, Call(pos, None, cache)))

    def p_body(self, ids, call):
        """(s0, e) of the rows: the initial state, the prelude's output (and the value
        embeddings); Ouro and LoopFormer: (the embedding, None)."""
        x = F.embedding(ids, self.embed.weight) * self.args.embed_scale  # [N, D]
        if self.pos_embed is not None:  # LoopFormer: learned positions
            x = x + self.pos_embed(call.pos)
        if not self.args.inject:
            return x, None
        ve = self.value_embeddings(ids)
        x = self._layers(self.prelude, x, call, ve)
        if self.prelude_norm is not None:
            x = rms_norm(x, self.prelude_norm, self.args.norm_eps)
        e = self.adapter.input(x) if self.args.injection == "diagonal" else x
        e = e if ve is None else torch.cat([e, ve], dim=-1)
        s0 = torch.zeros_like(x) if self.state_init == "zero" else self.initial_state(call.pos)
        return s0, e

    def r_body(self, s, e, call):
        x = self.inject(s, e) if self.args.inject else s
        mod = None if call.clock is None else call.clock[call.depth]  # LoopFormer: [(N,) L, 4D]
        x = self._layers(self.core, x, call, self.stored_value_embeddings(e), mod)  # ve: Parcae
        return rms_norm(x, self.norm, self.args.norm_eps) if self.args.norm_each_step else x

    def c_state(self, s, e, call):
        """C up to the head: the state [N, D] that `head` reads (the coda, the final norm)."""
        a = self.args
        if self.coda_in is not None:
            s = self.coda_in(s)
        if a.norm_before_coda:
            s = rms_norm(s, self.norm, a.norm_eps)
        if self.coda:
            s = self._layers(self.coda, s, call, self.stored_value_embeddings(e))
        if not a.norm_each_step:  # the final norm after the coda, not after each recurrence
            s = rms_norm(s, self.norm, a.norm_eps)
        return s

    def head(self, h):
        return self.lm_head(h).float()  # [N, V]

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

    def rope(self, pos):
        """The RoPE rows of positions pos [N], cos and sin [N, 1, hd/2], in the rotation's
        arithmetic dtype (layers.transformer.apply_rope): made once per call."""
        dtype = torch.promote_types(self.dtype, torch.float32)
        return (t.index_select(0, pos)[:, None].to(dtype) for t in (self.rope_cos, self.rope_sin))

    def _layers(self, blocks, x, call, ve=None, mod=None):
        """The blocks over the call's rows x [N, D], the matmuls one batch: each block's attention
        calls `cache.attend` with this call's rows, grouped by depth once here (`cache.prepare`)."""
        cos, sin = self.rope(call.pos)  # RoPE rows and the rows' groups: once a call, not a layer
        cache = call.cache
        prepared = None if cache is None else cache.prepare(call)
        for j, blk in enumerate(blocks):
            # the block does not know the cache: it attends through this function of (q, k, v);
            # blk.layer_id picks its KV slots (kv.KVCache.slot: looped layers, prelude, coda)
            attend = (causal_attention if prepared is None
                      else partial(cache.attend, prepared, blk.layer_id))
            # forward itself: the hooks nn.Module's call would look for cost more than a layer's
            # arithmetic at a small width
            x = blk.forward(x, cos, sin, attend, ve, None if mod is None else mod[..., j, :])
        return x

    def clock_table(self, num_steps):
        """LoopFormer: every block's modulation (`modulation`) at each depth of a schedule of T =
        num_steps iterations, [T, L, 4D], which R gathers by each row's depth, so that a row's bits
        do not depend on its call. Depth d runs at t = d steps of dt = 1/T summed in the model's
        dtype, as the official loop over T iterations does: the clock follows the depth the model
        is run at, and a draft read at depth k < T is a prefix of that schedule. Made once per (T,
        dtype, device), from the weights as they are then."""
        key = (num_steps, self.dtype, self.device)
        if key not in self.clock_tables:
            dt = torch.full((1,), 1 / num_steps, dtype=self.dtype, device=self.device)
            t, rows = torch.zeros_like(dt), []
            for _ in range(num_steps):
                rows.append(self.modulation(t, dt))
                t = t + dt
            self.clock_tables[key] = torch.cat(rows)
        return self.clock_tables[key]

    def modulation(self, t, dt):
        """LoopFormer: each block's modulation at the clocks (t, dt) [B]: [B, L, 4D], per block
        (gate_attn, gate_mlp, scale_attn, scale_mlp)."""
        c = F.silu(self.clock(t, dt))
        return torch.stack([blk.ada(c) for blk in self.core], dim=1)

    def initial_state(self, pos):
        """Huginn's, Parcae's and the retrofits' "random" s0 at positions pos [N] (on the device;
        "zero": p_body's zeros): the like-init draw (a normal cut at +-3 sigma, times the embedding
        scale) made on the device by a counter-based function of (seed, position, channel), so a
        position gets the same s0 however often, by whichever schedule and in whichever batch or
        lane it is made."""
        a = self.args
        z = truncated_normal(self.s0_key, pos, a.dim)
        return (z * (a.init_std * a.embed_scale)).to(self.dtype)

    # -- full-sequence forward --------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids, num_steps=None, state=None):
        """Logits [N, V] (float32) of the model run at depth T = `num_steps` over the sequence,
        no cache (LoopFormer's clock: T steps of 1/T, its elastic depth). Huginn and Parcae start
        from the model's initial state, or from `state` [N, D] if given."""
        ids, context = torch.as_tensor(ids).reshape(-1).to(self.device), self.args.max_seq_len
        if len(ids) > context:
            raise ValueError(f"{len(ids)} positions exceed the model's context of {context}")
        pos = torch.arange(len(ids), device=self.device)
        s, e = self.P(ids, pos)
        if state is not None:
            if not self.args.inject:
                raise ValueError("an explicit initial state is only defined for Huginn and Parcae")
            state = torch.as_tensor(state).reshape(-1, self.args.dim) if state.numel() else state
            if tuple(state.shape) != (len(ids), self.args.dim):
                raise ValueError(f"state has shape {tuple(state.shape)}, expected "
                                 f"{(len(ids), self.args.dim)}")
            s = state.to(self.device, self.dtype)
        T = self.num_steps if num_steps is None else num_steps
        for d in range(T):
            s = self.R(s, e, pos, d, num_steps=T)
        return self.C(s, e, pos)


def from_config(config: dict, device="cpu", dtype=torch.float32, state_init="random", seed=0,
                init_seed=None, keys=None):
    """A model of this config. With init_seed, random weights (for tests and timing at real sizes);
    without, uninitialised memory that load() fills. The weights are refused before anything is
    allocated when they do not fit in the device's free memory. keys: the checkpoint's tensor
    names, where known (load)."""
    devices.check_device(device)
    a = ModelArgs.from_config(config, keys)
    with torch.device("meta"):
        model = LoopedLM(a, config, state_init, seed)
    devices.check_weights_fit(model, torch.device(device), dtype)
    # every tensor allocated once, in its dtype on its device: float32 first and a cast after would
    # hold both (15 GB for Huginn in bfloat16). to_empty() gives every parameter its own storage,
    # so the tied head is untied before and tied after (else 0.7 GB for huginn-0125 in between)
    if a.tie_embeddings:
        model.lm_head.weight = None
    model = model.to(dtype).to_empty(device=device)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_table(a))  # fp32 in any dtype
    if a.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if init_seed is not None:  # drawn on the device: a real size's weights in seconds on a GPU
        g = torch.Generator(device).manual_seed(init_seed)
        draw = dict(generator=g, device=device)
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                w = 1 + 0.2 * (torch.rand(p.shape, **draw) - 0.5)
            elif name.endswith("qk_bias"):
                w = 0.3 * torch.randn(p.shape, **draw)
            else:
                w = torch.randn(p.shape, **draw) / math.sqrt(p.shape[-1])
            p.data.copy_(w)
    return model.eval().requires_grad_(False)


def load(source, device="cpu", dtype=None, state_init="random", seed=0):
    """A checkpoint of any family from a folder or hub id (formats/checkpoints.py), read tensor by
    tensor into a model allocated once (a 3.5B model is never in memory twice), every name, shape
    and value checked. dtype defaults to the checkpoint's."""
    devices.check_device(device)
    ckpt = checkpoints.Checkpoint(source)
    a = ModelArgs.from_config(ckpt.config, ckpt.weights.keys())
    model = from_config(ckpt.config, device, dtype or ckpt.dtype(a), state_init, seed,
                        keys=ckpt.weights.keys())
    ckpt.load_into(model)
    return model


save = checkpoints.save  # config.json and the weights in the family's official layout (for load)
