"""Compiled decoding's attention, two ways (issue 20): the project's blocks (kv.py: one graph per power
of two of the key blocks a call reads) against FlexAttention with a block mask held in tensors (one
graph, the masked blocks skipped inside the kernel). Ouro only: every layer is looped.

    python docs/attention/flex_vs_blocks.py [--quick]

The figures: docs/attention/README.md.
"""
import os
import sys
import tempfile

# a fresh inductor cache, so that the compile seconds are not those of an earlier run
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="flex_vs_blocks_"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import json
import random
import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import compilation_time_metrics
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import kv
import models
import wfd


@dataclass
class FlexStep(kv.Step):
    mask: BlockMask = None  # which key blocks each lane reads, in which depth's batch


class FlexKVCache(kv.KVCache):
    """kv.KVCache whose decoding calls attend by flex_attention. Per layer, the batch is that layer's
    T depth slots ([T, Hkv, S, hd], read in place); every lane's query sits in every slot's batch, and
    the block mask gives a lane key blocks only in its own depth's batch, up to its position: query
    blocks of one row, so the kernel skips every other block."""

    def __init__(self, model, capacity, num_steps):
        super().__init__(model, capacity, num_steps)
        # a buffer per layer in place of kv's one (allocated, then dropped): compiled on a CPU, flex_attention reads a view of the
        # cache from its storage's start, ignoring the view's offset (torch 2.13; layers 1.. read layer 0)
        shape = (self.num_steps, *self.k.shape[1:])  # [T, Hkv, scratch + 1, hd]
        self.keys, self.values = ([self.k.new_zeros(shape) for _ in range(self.n_core)] for _ in range(2))
        del self.k, self.v

    def buffers(self):
        return self.keys + self.values

    def span(self, pos, bucket=False):
        return min(super().span(pos), 1)  # the capacity check; 0 for the prefill, else one graph for all

    def prepare(self, pos, depth, span):
        if span == 0:
            return super().prepare(pos, depth, span)
        depth = depth if torch.is_tensor(depth) else torch.full_like(pos, depth)
        col = torch.where(pos < 0, self.scratch, pos)
        return FlexStep(col, span, depth=depth, mask=self.block_mask(pos, depth))

    def block_mask(self, pos, depth):
        b, n, blocks, cols = self.block, len(pos), self.scratch // self.block, self.scratch
        p = pos[None, None]  # [1, 1, N]: batch (depth slot), head, query row
        mine = (depth == torch.arange(self.num_steps, device=pos.device)[:, None])[:, None] & (p >= 0)  # [T, 1, N]
        full = (p + 1) // b  # the blocks a row sees whole; the next one, if any, in part
        part_num = (mine & ((p + 1) % b != 0)).int()
        full_num = torch.where(mine, full, 0).int()
        order = torch.arange(blocks, device=pos.device)
        part_idx = ((order + full[..., None]) % blocks).int().expand(self.num_steps, 1, n, blocks)  # first: block `full`
        full_idx = order.int().expand(self.num_steps, 1, n, blocks)
        return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(1, b),
                                        mask_mod=lambda _b, _h, q, key: key <= pos[q], seq_lengths=(n, cols),
                                        compute_q_blocks=False)

    def attend(self, step, layer, q, k, v):
        keys, values = self.keys[layer], self.values[layer]  # [T, Hkv, scratch + 1, hd]
        if step.span == 0:  # the prefill: every row at one depth
            keys[step.depth0][:, step.col], values[step.depth0][:, step.col] = k.transpose(0, 1), v.transpose(0, 1)
            return kv.causal_attention(q, k, v)
        keys[step.depth, :, step.col], values[step.depth, :, step.col] = k, v
        # the queries copied: a view of q fails in inductor's CPU template ("not enough values to unpack")
        qs = q.transpose(0, 1)[None].expand(self.num_steps, -1, -1, -1).contiguous()  # [T, H, N, hd]
        y = flex_attention(qs, keys[:, :, :self.scratch], values[:, :, :self.scratch], block_mask=step.mask,
                           enable_gqa=True)  # [T, H, N, hd]
        return y[step.depth, :, torch.arange(len(q), device=q.device)]  # each lane from its depth: [N, H, hd]


def flex_cache(model, capacity, num_steps, window, batch=1):
    if window is not None or model.args.n_prelude or model.args.n_coda or batch > 1:
        raise ValueError("the flex variant has Ouro's full per-depth cache of one sequence only")
    return FlexKVCache(model, capacity, num_steps)


def compiled_graphs():
    """The graphs dynamo holds for the R call, both variants together (Ouro's P runs eager, and its
    C reads no attention: both variants share one read graph)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(models.LoopedLM.r_body))


def compile_seconds():
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def decode(model, prompt, method, new, capacity, ref):
    """One compiled generation; with ref (AR's tokens), each draft is right with probability 0.9, the
    same draws for both variants. Returns the generation and its tokens per second after the prefill."""
    rng, stamps = random.Random(len(prompt)), []

    def hook(pos, token):
        i = pos - len(prompt)
        return token if i >= len(ref) else ref[i] if rng.random() < 0.9 else (ref[i] + 1) % model.args.vocab_size
    out = wfd.generate(model, prompt, new, method=method, capacity=capacity, compile=True, keep_logits=True,
                       draft_hook=hook if ref else None, on_token=lambda t: stamps.append(time.perf_counter()))
    return out, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main(quick):
    torch.set_num_threads(1)
    config = json.load(open(os.path.join(ROOT, "configs", "ouro-mid.json")))
    variants = {name: models.from_config(config, init_seed=0) for name in ("blocks", "flex")}
    real_new_cache = kv.new_cache
    kv.new_cache = lambda model, *a: (flex_cache if model is variants["flex"] else real_new_cache)(model, *a)
    lengths, new, capacity = ([16, 300], 8, 1024) if quick else ([16, 300, 800, 1800], 64, 4096)
    ids = random.Random(0).choices(range(32000), k=max(lengths))
    rows, worst, same = [], 0.0, True
    for n in lengths:
        row, ref = {"prompt": n}, None
        for method in ("ar", "wfd"):
            got = {}
            for name, model in variants.items():  # interleaved: blocks, then flex, at each point
                graphs, seconds = compiled_graphs(), compile_seconds()
                decode(model, ids[:n], method, 2, capacity, ref)  # compiles what this point needs
                row["graphs", name] = row.get(("graphs", name), 0) + compiled_graphs() - graphs
                row["compile", name] = row.get(("compile", name), 0) + compile_seconds() - seconds
                out, row[method, name] = decode(model, ids[:n], method, new, capacity, ref)
                got[name] = out
            ref = ref or got["blocks"].tokens
            same &= got["blocks"].tokens == got["flex"].tokens
            worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(got["blocks"].logits, got["flex"].logits)))
        rows.append(row)
        print(f"prompt {n} done: {row}", file=sys.stderr, flush=True)
    print(f"{new} new tokens per generation, capacity {capacity}, {kv.BLOCK} keys a block; tok/s after the prefill; "
          "graphs (R calls') and compile s: what the point's first generations added, AR and WFD together")
    print("\n| prompt (blocks read) | AR tok/s blocks / flex | WFD tok/s blocks / flex | flex / blocks AR, WFD "
          "| graphs made blocks / flex | compile s blocks / flex |\n|---|---|---|---|---|---|")
    for r in rows:
        reads = (r["prompt"] + new - 2) // kv.BLOCK + 1
        print(f"| {r['prompt']} ({reads}) | {r['ar', 'blocks']:.2f} / {r['ar', 'flex']:.2f} "
              f"| {r['wfd', 'blocks']:.2f} / {r['wfd', 'flex']:.2f} "
              f"| {r['ar', 'flex'] / r['ar', 'blocks']:.2f}x, {r['wfd', 'flex'] / r['wfd', 'blocks']:.2f}x "
              f"| {r['graphs', 'blocks']} / {r['graphs', 'flex']} | {r['compile', 'blocks']:.0f} / {r['compile', 'flex']:.0f} |")
    total = lambda key, name: sum(r[key, name] for r in rows)
    print(f"| all | | | | {total('graphs', 'blocks')} / {total('graphs', 'flex')} "
          f"| {total('compile', 'blocks'):.0f} / {total('compile', 'flex'):.0f} |")
    print(f"\ntokens equal: {same}; max |logit difference|, flex against blocks: {worst:.3g}")


if __name__ == "__main__":
    main("--quick" in sys.argv)
