"""A looped LM (Ouro) on vLLM's tensor-parallel layers and paged attention, and its own draft.

The weight-shared block runs T times per token, as models.py's R does; every (depth d, layer j) has an
`Attention` layer of its own (layers.{d L + j}: vLLM wants one index in a layer's name), so each depth keeps its own paged KV (models.py's KV slot per depth),
while the depths share the layer's weights. The norms, RoPE and SwiGLU are the project's
(layers/transformer.py), the configs and the checkpoints' tensor names are formats/'s.

Self-speculation: vLLM's `speculative_config={"method": "draft_model", "model": <the same
checkpoint>, ...}` builds this class a second time as the draft (prefix "draft_model"). The draft
runs the same checkpoint at its draft depth k: the target's `wfd_draft_steps` (settable per run by
`hf_overrides={"wfd_draft_steps": k}`, which vLLM applies to the target's config only), else the
config's, else max(1, T // 8). It takes the target's weights by reference (the target is built
first, in the same process): it owns no parameter, only its k x L attention layers and their KV.
"""
import os
import weakref
from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from formats import checkpoints
from layers.transformer import apply_rope, rms_norm, rope_table, swiglu
from models import ModelArgs

DRAFT_PREFIX = "draft_model"  # the prefix vLLM's DraftModelProposer builds its model under
SERVED = ("ouro",)  # the families this module runs (ModelArgs.kind)
# a fused parameter's parts in checkpoint_layout's order -> the vLLM weight loader's shard ids
SHARD_IDS = {"qkv.weight": ("q", "k", "v"), "fc.weight": (0, 1)}
_targets = {}  # checkpoint folder -> the target model built last for it in this process (weakref)


def model_args(hf_config):
    """formats/'s reading of config.json into models.ModelArgs, or the ValueError naming the
    problem."""
    a = ModelArgs.from_config(hf_config.to_dict())
    if a.kind not in SERVED:
        raise ValueError(f"the vLLM plugin serves {', '.join(SERVED)} models, not {a.kind}")
    return a


def draft_depth(vllm_config, T):
    """The draft depth k: the target's wfd_draft_steps (its config, or hf_overrides), else
    max(1, T // 8); refused unless 1 <= k < T."""
    target = vllm_config.speculative_config.target_model_config.hf_config
    k = getattr(target, "wfd_draft_steps", None) or max(1, T // 8)
    if not isinstance(k, int) or not 1 <= k < T:
        raise ValueError(f"draft depth wfd_draft_steps={k!r} must be an integer in 1..{T - 1} "
                         f"(the full depth T is {T})")
    return k


class LoopedBlock(nn.Module):
    """One weight-shared layer, this rank's shard: layers.transformer.Block's arithmetic (Ouro's
    sandwich norms: x + norm(f(norm(x)))) on vLLM's parallel linears; attention by the `attn`
    layer of the depth it runs at."""

    def __init__(self, a, prefix):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.eps, self.head_dim = a.norm_eps, a.head_dim
        self.q_size = a.n_heads // tp * a.head_dim
        self.kv_size = max(1, a.n_kv_heads // tp) * a.head_dim
        self.qkv = QKVParallelLinear(a.dim, a.head_dim, a.n_heads, a.n_kv_heads,
                                     bias=False, prefix=f"{prefix}.qkv")
        self.proj = RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False,
                                      prefix=f"{prefix}.proj")
        self.fc = MergedColumnParallelLinear(a.dim, [a.hidden_dim] * 2, bias=False,
                                             prefix=f"{prefix}.fc")
        self.down = RowParallelLinear(a.hidden_dim, a.dim, bias=False,
                                      prefix=f"{prefix}.down")
        for name in checkpoints.NORMS:
            setattr(self, name, nn.Parameter(torch.ones(a.dim), requires_grad=False))

    def forward(self, x, cos, sin, attn):
        q, k, v = self.qkv(rms_norm(x, self.attn_norm, self.eps))[0].split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = (apply_rope(t.unflatten(-1, (-1, self.head_dim)), cos, sin, False).flatten(1)
                for t in (q, k))
        x = x + rms_norm(self.proj(attn(q, k, v))[0], self.attn_out_norm, self.eps)
        h = swiglu(self.fc(rms_norm(x, self.mlp_norm, self.eps))[0])
        return x + rms_norm(self.down(h)[0], self.mlp_out_norm, self.eps)


class LoopedWeights(nn.Module):
    """Every parameter of the model, under models.py's names (formats.checkpoints'
    checkpoint_layout maps them to the checkpoint's tensors); the target owns them, its draft
    reads them."""

    def __init__(self, a, prefix):
        super().__init__()
        self.embed = VocabParallelEmbedding(a.vocab_size, a.dim, prefix=f"{prefix}.embed")
        self.core = nn.ModuleList(LoopedBlock(a, f"{prefix}.core.{j}") for j in range(a.n_core))
        self.norm = nn.Parameter(torch.ones(a.dim), requires_grad=False)
        self.lm_head = ParallelLMHead(a.vocab_size, a.dim, prefix=f"{prefix}.lm_head")
        if a.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        cos, sin = rope_table(a)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


class LoopedForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.args = a = model_args(model_config.hf_config)
        self.folder = os.path.realpath(model_config.model)
        T, L = a.num_steps, a.n_core
        self.is_draft = prefix == DRAFT_PREFIX
        target = self.is_draft and _targets.get(self.folder)
        target = target and target()
        if self.is_draft and target is None:
            raise ValueError("the draft of a looped model must be its own checkpoint "
                             f"({model_config.model} is not the target's): it runs the target's "
                             "weights at the draft depth")
        # the draft's reference to the target's weights stays out of its modules, so that vLLM
        # neither counts nor loads them a second time
        self.depth = draft_depth(vllm_config, T) if self.is_draft else T
        if self.is_draft:
            self.__dict__["weights"] = target.weights
        else:
            self.weights = LoopedWeights(a, f"{prefix}.weights" if prefix else "weights")
            _targets[self.folder] = weakref.ref(self)
        tp = get_tensor_model_parallel_world_size()
        hd = a.head_dim
        self.attn = nn.ModuleList(
            Attention(a.n_heads // tp, hd, hd ** -0.5, num_kv_heads=max(1, a.n_kv_heads // tp),
                      cache_config=vllm_config.cache_config,
                      prefix=f"{prefix + '.' if prefix else ''}layers.{d * L + j}.attn")
            for d in range(self.depth) for j in range(L))
        sizes = self.attn[0].attn_backend.get_supported_head_sizes()
        if sizes and hd not in sizes:
            raise ValueError(f"head_dim {hd} is not served by vLLM's "
                             f"{self.attn[0].attn_backend.get_name()} attention backend, which "
                             f"takes {sizes}")
        self.logits_processor = LogitsProcessor(a.vocab_size)

    def embed_input_ids(self, input_ids):
        return self.weights.embed(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        """The final state after `depth` recurrences (P, then R `depth` times: Ouro's norm after
        each), the attention of (depth d, layer j) in its own layer."""
        w = self.weights
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = w.rope_cos[positions], w.rope_sin[positions]
        L = len(w.core)
        for d in range(self.depth):
            for j, block in enumerate(w.core):
                x = block(x, cos, sin, self.attn[d * L + j])
            x = rms_norm(x, w.norm, self.args.norm_eps)
        return x

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.weights.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors by formats.checkpoints' layout, each shard by its vLLM weight
        loader; a missing tensor is refused by name. The draft loads nothing: its weights are the
        target's."""
        if self.is_draft:
            return set()
        tensors = dict(weights)
        layout, _, _ = checkpoints.checkpoint_layout(self.args)
        missing = sorted(k for parts in layout.values() for k, _ in parts if k not in tensors)
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
                for (key, _), shard in zip(parts, SHARD_IDS[name.split(".", 2)[-1]]):
                    loader(param, tensors[key], shard)
            loaded.add("weights." + name)
        return loaded
