"""Side by side on one checkpoint and the same prompts: vLLM's AR, vLLM's self-speculation (the
same checkpoint drafting at depth k, n tokens a step), and this project's AR and WFD, greedy.

    python serving/vllm/bench_vllm.py                                    # the demo
    python serving/vllm/bench_vllm.py --random-weights configs/ouro-mid.json

Each row: tokens/s over the prompts decoded one after another (after one untimed warm-up
prompt), then over all of them decoded together (batched: the project's generate of the list, one
slot per prompt; vLLM's generate of the list), tokens per target step (vLLM: 1 + the accepted
drafts per verify; the project: T / its R calls per token, full-depth passes' worth), the draft
acceptance, and whether the tokens are the project's AR's. Then vLLM's prefill of all the prompts
(one token each), its weights, its KV capacity in tokens and the draft's parameters. One thread
(OMP_NUM_THREADS=1), float32; vLLM in this process, eager."""
import argparse
import os
import sys
import tempfile
import time

os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import models  # noqa: E402
import engine  # noqa: E402
from demo import train as train_demo  # noqa: E402
from formats import checkpoints  # noqa: E402


def counters(llm):
    """vLLM's speculative-decoding counters so far: drafts (verify steps), accepted tokens."""
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (found.get("vllm:spec_decode_num_drafts", 0),
            found.get("vllm:spec_decode_num_accepted_tokens", 0),
            found.get("vllm:spec_decode_num_draft_tokens", 0))


def run_vllm(folder, prompts, n_new, ar_tokens, k=None, n=None):
    from vllm import LLM, SamplingParams
    spec = n and {"method": "draft_model", "model": folder, "num_speculative_tokens": n}
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, seed=0, skip_tokenizer_init=True,
              speculative_config=spec, hf_overrides={"wfd_draft_steps": k} if k else None,
              disable_log_stats=False, max_model_len=len(max(prompts, key=len)) + n_new + 8)
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    run = lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
    run(prompts[:1])  # warm-up
    results = {}
    for mode, calls in (("one", [[p] for p in prompts]), ("batched", [prompts])):
        before, t0 = counters(llm), time.perf_counter()
        tokens = [t for ps in calls for t in run(ps)]
        wall = time.perf_counter() - t0
        drafts, accepted, drafted = (b - a for a, b in zip(before, counters(llm)))
        results[mode] = dict(tok_s=len(prompts) * n_new / wall,
                             per_step=1 + accepted / drafts if drafts else 1.0,
                             acceptance=accepted / drafted if drafted else None,
                             exact=tokens == ar_tokens)
    # the prompts' prefill: one token each, all together (with a draft: its first pass too, which
    # vLLM runs over every prompt token)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
    prefill_ms = 1000 * (time.perf_counter() - t0)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    memory = dict(prefill_ms=round(prefill_ms, 1), weights=weights,
                  kv_tokens=runner.cache_config.num_gpu_blocks * runner.cache_config.block_size,
                  draft_params=len(list(runner.drafter.model.parameters())) if n else None)
    llm.llm_engine.engine_core.shutdown()
    return dict(results, memory=memory)


def run_project(model, prompts, n_new, method, k=None):
    """Both modes: the prompts one at a time, then as one list (one slot each)."""
    generate = lambda p: engine.generate(model, p, n_new, method=method, draft_steps=k)
    generate(prompts[0])  # warm-up
    results = {}
    for mode, run in (("one", lambda: [generate(p) for p in prompts]),
                      ("batched", lambda: generate(prompts))):
        t0 = time.perf_counter()
        gens = run()
        wall = time.perf_counter() - t0
        r_calls = sum(g.stats["r_calls"] for g in gens) / (len(prompts) * n_new)
        accepted = [g.stats["acceptance"] for g in gens if method == "wfd"]
        results[mode] = dict(tok_s=len(prompts) * n_new / wall,
                             per_step=model.num_steps / r_calls,
                             acceptance=sum(accepted) / len(accepted) if accepted else None,
                             tokens=[g.tokens for g in gens])
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "demo"))
    p.add_argument("--random-weights", metavar="CONFIG",
                   help="an Ouro config.json: random weights, written to a temp folder")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--draft-steps", type=int, help="k (default: the config's, else max(1, T//8))")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    folder = args.model
    if args.random_weights:
        config = dict(checkpoints.read_json(args.random_weights),
                      architectures=["OuroForCausalLM"])
        folder = tmp.name
        models.save(models.from_config(config, init_seed=0), folder)
    model = models.load(folder)
    if model.tokenizer is not None:
        prompts = train_demo.eval_prompts(model.tokenizer, args.num_prompts, args.prompt_len)
    else:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(model.args.vocab_size, (args.num_prompts, args.prompt_len),
                                generator=g).tolist()
    k = args.draft_steps or model.config.get("wfd_draft_steps") or max(1, model.num_steps // 8)
    n_new, n = args.max_new_tokens, args.num_speculative_tokens
    ar = run_project(model, prompts, n_new, "ar")
    ar_tokens = ar["one"]["tokens"]
    rows = [("project AR", ar), ("project WFD", run_project(model, prompts, n_new, "wfd", k)),
            ("vLLM AR", run_vllm(folder, prompts, n_new, ar_tokens)),
            (f"vLLM self-speculation n={n}", run_vllm(folder, prompts, n_new, ar_tokens, k, n))]
    print(f"{args.random_weights or args.model}: T={model.num_steps} k={k}, {len(prompts)} prompts "
          f"x {n_new} tokens, greedy, float32, one thread")
    for mode, title in (("one", "one prompt at a time"), ("batched", "all prompts together")):
        print(f"\n{title}:\n")
        print("| method | tok/s | tokens per target step | acceptance | AR's tokens |")
        print("|---|---|---|---|---|")
        for name, r in rows:
            r = r[mode]
            exact = r["exact"] if "exact" in r else r["tokens"] == ar_tokens
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            print(f"| {name} | {r['tok_s']:.1f} | {r['per_step']:.2f} | {acc} | {exact} |")
    print()
    for name, r in rows[2:]:
        print(f"{name}: {r['memory']}")


if __name__ == "__main__":
    main()
