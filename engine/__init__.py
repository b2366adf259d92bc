"""The engine: wfd.py's schedules run exact in every precision and fast. Where the reference runs
one prompt call by call, the engine runs many in lanes of one fixed shape (model_runner.py), so
that a row computes the same bits in every schedule and beside any other rows; attends over key
blocks merged exactly (kv_cache.py); stages what the host sends without blocking the device
(staging.py); compiles its calls, with CUDA graphs on a GPU (compiling.py); batches prompts with
refill (scheduler.py); samples with noise that every schedule draws alike (sampling.py); adds the
second proposal (siblings.py). docs/engine.md maps each part to the reference line it replaces.

generate() takes every option of wfd.generate, and more."""
import time
from functools import partial
from typing import Callable

import torch
from torch._dynamo.utils import counters

from engine import checks, compiling
from engine.kv_cache import cache_bytes
from engine.model_runner import Decoder
from layers.noise import seed_key
from engine.scheduler import decode
from engine.sequence import Sequence
from engine.siblings import wavefront_siblings
from wfd import Generation, autoregressive, draft_then_verify, wavefront


def compile_graphs(model, prompt_ids, max_new_tokens, **settings):
    """Compile every graph that generate(model, prompt_ids, max_new_tokens, compile=True,
    **settings) can meet (model_runner.Decoder.warm_up), so that a timed generation compiles none;
    settings: generate's, the callbacks aside. Returns the graphs compiled (0: they all existed)."""
    digest = settings.pop("digest_logits", False)
    p = checks.plan(model, prompt_ids, max_new_tokens, **dict(settings, compile=True))
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        Decoder(model, p.slots, p.capacity, num_steps=p.num_steps, width=p.width, window=p.window,
                sampling=p.sampling, compile=True, digest=digest,
                branching=settings.get("second_depth") is not None).warm_up()
    return counters["stats"]["unique_graphs"] - graphs


def generate(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
             draft_len=4, width=None, capacity=None, eos_token_id=None, kv="full", window=None,
             temperature=0.0, top_k=None, top_p=None, seed=0, batch_size=None,
             draft_hook: Callable[..., int] = None, on_token: Callable = None,
             on_finish: Callable = None, trace: list = None, keep_logits=False, digest_logits=False,
             compile=False, second_depth=None):
    """Greedy or sampled decoding of one prompt, returning Generation(tokens, stats, logits), or of
    a list of prompts (docs/batching.md: batch_size slots, one per prompt by default, refilled as
    they finish), returning one Generation per prompt, in order.

    T = num_steps, k = draft_steps, width: rows per R / C call (docs/exactness.md); capacity: the
    KV positions per sequence; eos_token_id: an id or a collection of them (stats["stop_token"]
    says which ended it); kv="shared" and window: docs/shared-kv.md; temperature, top_k, top_p,
    seed (a list of them for several prompts): docs/sampling.md. draft_hook(pos, token) -> token may
    replace each draft (the output must not change); on_token(token) as each token commits (both
    take the prompt's index first when there are several); on_finish(i, generation) as prompt i
    finishes. trace: a list that receives one dict per R call. keep_logits: the committed logits in
    Generation.logits; digest_logits: a digest of their bits, hashed on the device, in
    stats["logits_digest"] (equal digests: bit-equal logits, but for a chance of about 2^-32).
    compile: docs/compiling.md; stats["graphs_compiled"] counts the graphs made during the
    generation (none after compile_graphs), stats["cuda_graphs_rerecorded"] and
    ["cuda_graphs_skipped"] the CUDA graphs re-recorded and skipped (none).

    second_depth m (k < m < T): the wavefront's second proposal (siblings.wavefront_siblings,
    docs/siblings.md); draft_hook(pos, token, depth=m) is then called for the second proposals too.
    With method "ar" it runs AR through the same calls (branch columns and all), the reference of
    the second proposal at its width."""
    p = checks.plan(model, prompt_ids, max_new_tokens, method=method, num_steps=num_steps,
                    draft_steps=draft_steps, draft_len=draft_len, width=width, capacity=capacity,
                    eos_token_id=eos_token_id, kv=kv, window=window, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size, compile=compile,
                    second_depth=second_depth)
    T, k, m = p.num_steps, p.draft_steps, second_depth
    schedule = dict(ar=autoregressive,
                    wfd=partial(wavefront, k=k) if m is None else partial(wavefront_siblings, k=k,
                                                                            m=m),
                    dtv=partial(draft_then_verify, k=k, draft_len=draft_len))[method]
    own = (lambda f, i: f and partial(f, i)) if p.batched else (lambda f, i: f)  # prompt i's
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    dec = Decoder(model, p.slots, p.capacity, num_steps=T, width=p.width, window=p.window,
                  sampling=p.sampling, compile=compile, digest=digest_logits,
                  branching=m is not None)
    settings = dict(method=method, num_steps=T, draft_steps=k if method != "ar" else T, kv=kv,
                    window=p.window, width=p.width, batch_size=p.slots, temperature=temperature,
                    top_k=top_k, top_p=top_p, compiled=compile, eos_token_ids=sorted(p.stop),
                    kv_bytes=dec.cache.nbytes, second_depth=m,
                    branch_kv_bytes=dec.cache.nbytes - cache_bytes(model, p.capacity, T, p.window,
                                                                   p.slots))
    graphs, generations = counters["stats"]["unique_graphs"], [None] * len(p.prompts)
    cuda_graphs = compiling.cuda_graph_counts(model.device)

    def finish(seq):
        """A sequence's Generation as it finishes (graphs and peak memory: the counts so far)."""
        stats, n, wall = seq.stats, len(seq.tokens), time.perf_counter() - seq.t0
        verified = stats["verified"]
        stats.update(settings, tokens=n, r_calls_per_token=stats["r_calls"] / n, wall_s=wall,
                     acceptance=stats["accepted"] / verified if verified else float("nan"),
                     tokens_per_s=n / wall, slot=seq.slot, seed=p.seeds[seq.index],
                     graphs_compiled=counters["stats"]["unique_graphs"] - graphs,
                     **dict(zip(("cuda_graphs_rerecorded", "cuda_graphs_skipped"), (
                         now - before for now, before in zip(
                             compiling.cuda_graph_counts(model.device), cuda_graphs)))),
                     peak_memory_bytes=torch.cuda.max_memory_allocated(model.device) if cuda
                     else None,
                     logits_digest=seq.digest and seq.digest.hexdigest())
        generations[seq.index] = Generation(seq.tokens, stats, seq.logits)
        if on_finish:
            on_finish(seq.index, generations[seq.index])

    with torch.no_grad():
        seqs = [Sequence(i, prompt, p.max_new_tokens, T, key=seed_key(p.seeds[i]), stop=p.stop,
                         batched=p.batched, width=p.width, draft_hook=own(draft_hook, i),
                         on_token=own(on_token, i), trace=trace, keep_logits=keep_logits,
                         digest_logits=digest_logits)
                for i, prompt in enumerate(p.prompts)]
        decode(dec, [seqs[b::p.slots] for b in range(p.slots)], schedule, finish)
    return generations if p.batched else generations[0]
