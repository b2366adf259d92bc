"""Looped LMs (Ouro, Huginn and the Raven retrofits, LoopFormer, Parcae) on vLLM's tensor-parallel
layers and paged attention, drafting from their own shallow depth.

P, R and C are models.py's: P embeds the tokens (Huginn: and runs the prelude, whose output e every
recurrence reads through the adapter, from an initial state drawn per position; Parcae: the
prelude, ln_prelude, and e the diagonal injection's input term), R runs the weight-shared block
(Ouro: then its norm; Parcae: on s * decay + e), T times per token, C reads the state out (Huginn:
ln_f, the coda, ln_f; Parcae: the map C, the coda, ln_f). Parcae's blocks mix value embeddings
(tables by token id, this rank's kv heads' columns) into v behind per-head gates, and norm q and
k after RoPE. Every prelude and coda layer, and every (depth d, core layer j), has an
`Attention` layer of its own (named layers.{i}: vLLM wants one index in a layer's name), so each
depth keeps its own paged KV (models.py's KV slot per depth) while the depths share the layer's
weights. The norms, RoPE, SwiGLU and Huginn's initial state are the project's (layers/,
layers/noise.py); the configs and the checkpoints' tensor names are formats/'s.

Self-speculation: vLLM's `speculative_config={"method": "draft_model", "model": <the same
checkpoint>, ...}` builds this class a second time as the draft (prefix "draft_model"). The draft
runs the same checkpoint at its draft depth k: the target's `wfd_draft_steps` (settable per run by
`hf_overrides={"wfd_draft_steps": k}`, which vLLM applies to the target's config only), else
max(1, T // 8). It takes the target's weights by reference (the target is built first, in the
same process): it owns no parameter, only its attention layers (k x L in the core), and those
of its prelude and core are bound to the target's KV of the same layer (DraftAttention): only its
coda's KV is its own.
"""
import os
import weakref
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_reduce)
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                               QKVParallelLinear, ReplicatedLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from formats import checkpoints, configs
from layers.transformer import (MLPS, QK_NORM_EPS, VE_GATE_CHANNELS, Block, Clock,
                                DiagonalInjection, apply_rope, rms_norm, rope_table, value_gate)
from models import S0_STREAM, ModelArgs
from layers import noise
from wfd_vllm import SCALING

DRAFT_PREFIX = "draft_model"  # the prefix vLLM's DraftModelProposer builds its model under
SERVED = ("ouro", "huginn", "retrofit", "loopformer", "parcae")  # ModelArgs.kind
# a fused parameter's parts in checkpoint_layout's order -> the vLLM weight loader's shard ids
SHARD_IDS = {"qkv.weight": ("q", "k", "v"), "fc.weight": (0, 1)}
SEED = 0  # models.LoopedLM's default seed, where the engine has none
_targets = {}  # checkpoint folder -> the target model built last for it in this process (weakref)


def model_args(model_config):
    """formats/'s reading of config.json into models.ModelArgs, or the ValueError naming the
    problem. What config.json leaves out, as formats.checkpoints.Checkpoint finds it: whether a
    huginn_raven config is huginn-0125's or a retrofit's (the checkpoint's tensor names),
    LoopFormer's iteration count (the repo id's)."""
    config, keys = model_config.hf_config.to_dict(), None
    if config.get("model_type") == "parcae":  # a dump, named by its _class_name (ParcaeConfig)
        del config["model_type"]
    if SCALING in config:
        config["rope_scaling"] = config.pop(SCALING)
    if config.get("model_type") == "huginn_raven":
        keys = checkpoints.Weights(checkpoints.resolve(model_config.model)).keys()
    if config.get("model_type") == "loopformer" and "max_model_loops" not in config:
        loops = configs.iterations_in_name(model_config.model)  # else the default, 8
        config.update({"max_model_loops": loops} if loops else {})
    a = ModelArgs.from_config(config, keys)
    if a.kind not in SERVED:
        raise ValueError(f"the vLLM plugin serves {', '.join(SERVED)} models, not {a.kind}")
    return a


def state_seed(model_config):
    """The seed of Huginn's, Parcae's and the retrofits' initial state: the engine's seed. A
    request's own SamplingParams.seed cannot move it: the model's forward is not told which
    request a token belongs to (docs/serving.md)."""
    seed = SEED if model_config.seed is None else model_config.seed
    if type(seed) is not int or seed < 0:
        raise ValueError(f"the engine's seed {seed!r} must be an integer >= 0: it seeds the "
                         "initial state, as the project's --seed does")
    return seed


class DraftAttention(Attention):
    """A draft's attention layer on the target's cache of the same layer (vLLM's
    kv_sharing_target_layer_name). vLLM lets such a layer read that cache but not write it, so it
    writes its rows' keys and values itself, through the cache update vLLM's own layers use: the
    draft's positions past the committed ones are then there for its next drafts to read, and the
    target's verify rewrites them; at committed positions it writes the keys already there."""

    def forward(self, query, key, value, *args, **kwargs):
        shape = (-1, self.num_kv_heads, self.head_size)
        unified_kv_cache_update(key.view(shape), value.view(shape), self.layer_name)
        return super().forward(query, key, value, *args, **kwargs)


def draft_depth(vllm_config, T):
    """The draft depth k: the target's wfd_draft_steps (its config, or hf_overrides), else
    max(1, T // 8); refused unless 1 <= k < T."""
    target = vllm_config.speculative_config.target_model_config.hf_config
    k = getattr(target, "wfd_draft_steps", None)
    k = max(1, T // 8) if k is None else k  # 0 is a depth to refuse, not a default to take
    # bool is an int subclass: True would run as k = 1
    if type(k) is not int or not 1 <= k < T:
        raise ValueError(f"draft depth wfd_draft_steps={k!r} must be an integer in 1..{T - 1} "
                         f"(the full depth T is {T})")
    return k


class LoopedBlock(nn.Module):
    """One layer, this rank's shard: layers.transformer.Block's arithmetic (Ouro's x + norm(f(norm
    x)), Huginn's norm(x + f(norm x)) with a bias on q and k and RoPE on adjacent pairs, a Llama
    retrofit's x + f(norm x), an OLMo-2 retrofit's x + norm(f(x)) with q and k norms) on vLLM's
    parallel linears; attention by the `attn` layer of the depth it runs at."""

    def __init__(self, a, prefix, hidden_dim, ve_index=None):
        """hidden_dim: its MLP's width; ve_index (Parcae): which of the value-embedding tables
        it mixes into v (None: none)."""
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.args, self.heads = a, a.n_heads // tp
        self.q_size = self.heads * a.head_dim
        self.kv_size = max(1, a.n_kv_heads // tp) * a.head_dim
        self.qkv = QKVParallelLinear(a.dim, a.head_dim, a.n_heads, a.n_kv_heads,
                                     bias=False, prefix=f"{prefix}.qkv")
        self.proj = RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False,
                                      prefix=f"{prefix}.proj")
        self.fc = (MergedColumnParallelLinear(a.dim, [hidden_dim] * 2, bias=False,
                                              prefix=f"{prefix}.fc") if a.mlp == "swiglu" else
                   ColumnParallelLinear(a.dim, hidden_dim, bias=False, prefix=f"{prefix}.fc"))
        self.down = RowParallelLinear(hidden_dim, a.dim, bias=False, prefix=f"{prefix}.down")
        norm = lambda width, on: (nn.Parameter(torch.ones(width), requires_grad=False) if on
                                  else None)
        weighted_in = a.in_norm and a.norm_weights  # LoopFormer's input norms have no weight
        self.attn_norm, self.mlp_norm = norm(a.dim, weighted_in), norm(a.dim, weighted_in)
        self.attn_out_norm, self.mlp_out_norm = norm(a.dim, a.sandwich), norm(a.dim, a.sandwich)
        # OLMo-2: over the whole q and k projections, every head: this rank's share
        self.q_norm, self.k_norm = norm(self.q_size, a.qk_proj_norm), norm(self.kv_size,
                                                                           a.qk_proj_norm)
        # Parcae: the value-embedding gate's rows of this rank's kv heads
        self.ve_index = ve_index
        self.ve_gate = ve_index is not None and nn.Linear(
            VE_GATE_CHANNELS, self.kv_size // a.head_dim, bias=False).requires_grad_(False) or None
        for p in (self.q_norm, self.k_norm, self.ve_gate and self.ve_gate.weight):
            if p is not None:
                p.weight_loader = self.load_heads
        if a.qk_bias:  # [2, 1, heads, head_dim]: this rank's heads
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, a.head_dim),
                                        requires_grad=False)
            self.qk_bias.weight_loader = self.load_qk_bias
        else:
            self.qk_bias = None
        # LoopFormer's adaLN modulation: gates and scales of the residual's width, on every rank
        self.ada = a.clock and ReplicatedLinear(a.dim, 4 * a.dim, prefix=f"{prefix}.ada") or None

    def load_qk_bias(self, param, loaded):
        first = get_tensor_model_parallel_rank() * self.heads
        param.data.copy_(loaded[:, :, first:first + self.heads])

    @staticmethod
    def load_heads(param, loaded):
        """A q or k norm's weights of this rank's heads (where there are fewer kv heads than
        ranks, vLLM gives consecutive ranks the same kv head)."""
        width, tp = param.shape[0], get_tensor_model_parallel_world_size()
        replicas = max(1, tp // (loaded.shape[0] // width))
        first = get_tensor_model_parallel_rank() // replicas * width
        param.data.copy_(loaded[first:first + width])

    def qk_proj_norm(self, t, weight):
        """OLMo-2's norm over a whole projection: rms_norm, its mean square over every rank's
        heads (summed over the ranks; replicated kv heads count once per rank on both sides)."""
        a, tp = self.args, get_tensor_model_parallel_world_size()
        if tp == 1:
            return rms_norm(t, weight, a.norm_eps)
        tf = t.float()
        squares = tensor_model_parallel_all_reduce(tf.pow(2).sum(-1, keepdim=True))
        mean = squares / (t.shape[-1] * tp)
        return (tf * torch.rsqrt(mean + a.norm_eps)).to(t.dtype) * weight

    def forward(self, x, cos, sin, attn, mod=None, ve=None):
        """mod (LoopFormer): the block's modulation at the rows' depth, [4D]; ve (Parcae): the
        rows' value embeddings of this block's table, this rank's kv heads, [N, kv width]."""
        a = self.args
        gate_attn, gate_mlp, scale_attn, scale_mlp = [None] * 4 if mod is None else mod.chunk(4, -1)
        h = self.sublayer_input(x, self.attn_norm, scale_attn)
        q, k, v = self.qkv(h)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.ve_gate is not None:  # v + 2 sigmoid(gate of h) x ve, per kv head
            gate = value_gate(h, self.ve_gate.weight)
            v = v + (gate[..., None] * ve.unflatten(-1, (-1, a.head_dim))).flatten(1)
        if self.q_norm is not None:
            q, k = self.qk_proj_norm(q, self.q_norm), self.qk_proj_norm(k, self.k_norm)
        q, k = (t.unflatten(-1, (-1, a.head_dim)) for t in (q, k))
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        if a.rope:
            q, k = (apply_rope(t, cos, sin, a.interleaved_rope) for t in (q, k))
        if a.qk_norm:  # Parcae: a weightless norm of each head, after RoPE
            q, k = rms_norm(q, None, QK_NORM_EPS), rms_norm(k, None, QK_NORM_EPS)
        x = self.residual(x, self.proj(attn(q.flatten(1), k.flatten(1), v))[0],
                          self.attn_out_norm, gate_attn)
        h = MLPS[a.mlp](self.fc(self.sublayer_input(x, self.mlp_norm, scale_mlp))[0])
        return self.residual(x, self.down(h)[0], self.mlp_out_norm, gate_mlp)

    # the project's norm placements (ModelArgs.in_norm, sandwich, post_norm), read from self.args
    sublayer_input, residual = Block.sublayer_input, Block.residual


class LoopedWeights(nn.Module):
    """Every parameter of the model, under models.py's names (formats.checkpoints'
    checkpoint_layout maps them to the checkpoint's tensors); the target owns them, its draft
    reads them."""

    def __init__(self, a, prefix):
        super().__init__()
        mixing = a.value_embeds  # Parcae: the blocks (0.. over prelude, core, coda) that mix

        def blocks(name, n, first, hidden):  # first: the first block's index in that count
            return nn.ModuleList(
                LoopedBlock(a, f"{prefix}.{name}.{i}", hidden,
                            mixing.index(first + i) if first + i in mixing else None)
                for i in range(n))

        self.vocab_size = a.vocab_size
        self.embed = VocabParallelEmbedding(a.vocab_size, a.dim, prefix=f"{prefix}.embed")
        self.prelude = blocks("prelude", a.n_prelude, 0, a.hidden_dim)
        self.core = blocks("core", a.n_core, a.n_prelude, a.core_hidden_dim or a.hidden_dim)
        self.coda = blocks("coda", a.n_coda, a.n_prelude + a.n_core, a.hidden_dim)
        # Huginn's adapter of concat(s, e); Parcae's diagonal injection (replicated: [D] and D x D)
        self.adapter = None if not a.inject else (
            DiagonalInjection(a.dim).requires_grad_(False) if a.injection == "diagonal" else
            ReplicatedLinear(2 * a.dim, a.dim, bias=False, prefix=f"{prefix}.adapter"))
        self.norm = nn.Parameter(torch.ones(a.dim), requires_grad=False)
        # Parcae: ln_prelude, the map C into the coda, and the value-embedding tables stacked
        # ([tables x V, kv width]), this rank's kv heads' columns
        self.prelude_norm = (nn.Parameter(torch.ones(a.dim), requires_grad=False)
                             if a.prelude_norm else None)
        self.coda_in = a.coda_in and ReplicatedLinear(a.dim, a.dim, bias=False,
                                                      prefix=f"{prefix}.coda_in") or None
        self.value_embed = None
        if mixing:
            width = max(1, a.n_kv_heads // get_tensor_model_parallel_world_size()) * a.head_dim
            self.value_embed = nn.Parameter(torch.zeros(len(mixing) * a.vocab_size, width),
                                            requires_grad=False)
            self.value_embed.weight_loader = self.load_value_table
        # LoopFormer: learned positions, and the clock whose modulations fill clock_table
        self.pos_embed = nn.Embedding(a.max_seq_len, a.dim) if a.pos_embed else None
        self.clock = Clock(a.dim) if a.clock else None
        self.clock_table = None
        self.lm_head = ParallelLMHead(a.vocab_size, a.dim, prefix=f"{prefix}.lm_head")
        if a.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        cos, sin = rope_table(a)  # Huginn's: its checkpoint's table, read by load_weights
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def load_value_table(param, loaded, table):
        """Parcae: value-embedding table number `table` ([V, kv width]) into its rows, the
        columns of this rank's kv heads (consecutive ranks share a kv head where there are fewer
        kv heads than ranks)."""
        width, tp = param.shape[1], get_tensor_model_parallel_world_size()
        replicas = max(1, tp // (loaded.shape[1] // width))
        first, V = get_tensor_model_parallel_rank() // replicas * width, loaded.shape[0]
        param.data[table * V:(table + 1) * V].copy_(loaded[:, first:first + width])

    def value_embedding(self, ids, table):
        """Parcae: the tokens' rows of value-embedding table `table`, [N, this rank's kv width]."""
        return F.embedding(ids + table * self.vocab_size, self.value_embed)


class LoopedForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.args = a = model_args(model_config)
        self.folder = os.path.realpath(model_config.model)
        self.is_draft = prefix == DRAFT_PREFIX
        target = self.is_draft and _targets.get(self.folder)
        target = target and target()
        if self.is_draft and target is None:
            raise ValueError("the draft of a looped model must be its own checkpoint "
                             f"({model_config.model} is not the target's): it runs the target's "
                             "weights at the draft depth")
        # the draft's reference to the target's weights stays out of its modules, so that vLLM
        # neither counts nor loads them a second time
        self.depth = draft_depth(vllm_config, a.num_steps) if self.is_draft else a.num_steps
        if self.is_draft:
            self.__dict__["weights"] = target.weights
        else:
            self.weights = LoopedWeights(a, f"{prefix}.weights" if prefix else "weights")
            _targets[self.folder] = weakref.ref(self)
        tp = get_tensor_model_parallel_world_size()
        hd, name = a.head_dim, f"{prefix + '.' if prefix else ''}layers"
        # prelude, then the core at each depth, then coda
        n_attn = a.n_prelude + self.depth * a.n_core + a.n_coda
        # the draft's prelude and core layers (depths 0..k-1) read and write the target's cache of
        # the same layer: the same keys at every committed position, so vLLM allocates them no KV;
        # its coda, which reads depth-k states, keeps a cache of its own
        shared = a.n_prelude + self.depth * a.n_core if self.is_draft else 0
        self.attn = nn.ModuleList(
            (DraftAttention if i < shared else Attention)(
                a.n_heads // tp, hd, hd ** -0.5, num_kv_heads=max(1, a.n_kv_heads // tp),
                cache_config=vllm_config.cache_config, prefix=f"{name}.{i}.attn",
                **({"kv_sharing_target_layer_name": target.attn[i].layer_name} if i < shared
                   else {}))
            for i in range(n_attn))
        sizes = self.attn[0].attn_backend.get_supported_head_sizes()
        if sizes and hd not in sizes:
            raise ValueError(f"head_dim {hd} is not served by vLLM's "
                             f"{self.attn[0].attn_backend.get_name()} attention backend, which "
                             f"takes {sizes}")
        self.logits_processor = LogitsProcessor(a.vocab_size)
        # the initial state's seed is the engine's (LLM(seed=N), the server's --seed N), as the
        # project's models.load(seed=N) / run.py --seed N; the draft takes the target's
        self.s0_key = target.s0_key if self.is_draft else noise.mix32(
            noise.seed_key(state_seed(model_config)) ^ S0_STREAM)

    def embed_input_ids(self, input_ids):
        return self.weights.embed(input_ids) * self.args.embed_scale

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        """The state C reads logits from: P, R `depth` times, then C up to the head."""
        w, a = self.weights, self.args
        if w.clock is not None and w.clock_table is None:
            # LoopFormer without its modulation would run, wrongly and silently
            raise RuntimeError("LoopFormer's clock table is not made: it is made from the "
                               "checkpoint's weights by load_weights, which did not run (a "
                               "load_format that skips it, such as 'dummy', is not served)")
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = x if w.pos_embed is None else x + w.pos_embed(positions)
        # the rows of apply_rope: [N, 1, hd/2] in its arithmetic dtype (at least float32)
        dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = (t[positions][:, None].to(dtype) for t in (w.rope_cos, w.rope_sin))

        # Parcae: each mixing block's value embeddings, looked up once for every depth
        ve = {} if w.value_embed is None else {
            b.ve_index: w.value_embedding(input_ids, b.ve_index)
            for b in (*w.prelude, *w.core, *w.coda) if b.ve_index is not None}

        def layers(blocks, x, first, mod=None):  # the blocks, attending through attn[first], ...
            for i, block in enumerate(blocks):
                x = block(x, cos, sin, self.attn[first + i], None if mod is None else mod[i],
                          ve.get(block.ve_index))
            return x

        e, s = (layers(w.prelude, x, 0), self.initial_state(positions)) if a.inject else (None, x)
        if w.prelude_norm is not None:
            e = rms_norm(e, w.prelude_norm, a.norm_eps)
        diagonal = a.injection == "diagonal"  # Parcae: s * decay + softplus(dt) (e B^T)
        e, decay = (w.adapter.input(e), w.adapter.decay()) if a.inject and diagonal else (e, None)
        for d in range(self.depth):
            h = s if not a.inject else (s * decay + e if diagonal else
                                        w.adapter(torch.cat([s, e], dim=-1))[0])
            mod = None if w.clock_table is None else w.clock_table[d]
            s = layers(w.core, h, a.n_prelude + d * a.n_core, mod)
            s = rms_norm(s, w.norm, a.norm_eps) if a.norm_each_step else s
        s = s if w.coda_in is None else w.coda_in(s)[0]
        s = rms_norm(s, w.norm, a.norm_eps) if a.norm_before_coda else s
        s = layers(w.coda, s, a.n_prelude + self.depth * a.n_core)
        return s if a.norm_each_step else rms_norm(s, w.norm, a.norm_eps)

    def initial_state(self, positions):
        """Huginn's s0: models.LoopedLM.initial_state's draw ("random", the engine's seed), a
        function of the position alone."""
        a = self.args
        z = noise.truncated_normal(self.s0_key, positions, a.dim)
        return (z * (a.init_std * a.embed_scale)).to(self.weights.norm.dtype)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.weights.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors by formats.checkpoints' layout, each shard by its vLLM weight
        loader; a missing tensor is refused by name. The draft loads nothing: its weights are the
        target's."""
        if self.is_draft:
            # read to the end all the same: vLLM's loader starts its "Loading weights took"
            # clock at the iterator's first tensor, and without one it reports its uptime
            for _ in weights:
                pass
            return set()
        tensors = dict(weights)
        layout, _, rope = checkpoints.checkpoint_layout(self.args)
        missing = sorted(k for parts in layout.values() for k, _ in parts if k not in tensors)
        missing += [rope] if rope and rope not in tensors else []
        if missing:
            raise ValueError(f"checkpoint {self.folder} lacks tensor {missing[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        params, loaded = dict(self.named_parameters()), set()
        for name, parts in layout.items():
            param = params["weights." + name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if len(parts) == 1:
                loader(param, tensors[parts[0][0]])
            else:
                # Parcae's value tables: by their number
                shards = SHARD_IDS.get(name.split(".", 2)[-1], range(len(parts)))
                for (key, _), shard in zip(parts, shards):
                    loader(param, tensors[key], shard)
            loaded.add("weights." + name)
        if rope:  # Huginn's stored RoPE table, [1, positions, 1, head_dim / 2, (cos, sin)]
            for i, buffer in enumerate((self.weights.rope_cos, self.weights.rope_sin)):
                buffer.copy_(tensors[rope][0, :, 0, :, i])
        if self.weights.clock is not None:
            self.weights.clock_table = self.clock_table()
        return loaded

    @torch.no_grad()
    def clock_table(self):
        """LoopFormer: every block's modulation at each depth d of T, [T, L, 4D], as
        models.LoopedLM.clock_table makes it: the clock at t = d steps of dt = 1 / T, summed in
        the weights' dtype; the draft, at depth k < T, reads the first k rows."""
        w, T = self.weights, self.args.num_steps
        dt = torch.full((1,), 1 / T, dtype=w.norm.dtype, device=w.norm.device)
        t, rows = torch.zeros_like(dt), []
        for _ in range(T):
            c = F.silu(w.clock(t, dt))
            # the plain weights (load_weights' time: before vLLM readies its linears for the CPU)
            rows.append(torch.stack([F.linear(c, b.ada.weight, b.ada.bias) for b in w.core], 1))
            t = t + dt
        return torch.cat(rows)
