"""Train the demo model in demo/: a small looped LM in Ouro's format, trained on the Python standard
library's own source, which every machine that runs this has.

    python demo/train.py                      # the demo: ~36 min on 2 CPU cores, writes demo/
    python demo/train.py --smoke --out DIR    # a few steps on a tiny slice, seconds (the tests
                                                run it)
    python demo/train.py --eval               # docs/demo.md's figures, measured on held-out files

Deterministic: a fixed seed, a fixed step count, files read in sorted order. It trains on library
code only (data/stdlib.py's split); the held-out library files are never trained on: they give the
evaluation text and prompts.
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

# the project's modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402
import engine  # noqa: E402
from cli.args import set_threads  # noqa: E402
from data.stdlib import library_split  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EOS = "<|endoftext|>"
CONFIG = dict(  # Ouro's config.json keys: 2 shared layers looped 4 times
    architectures=["OuroForCausalLM"], model_type="ouro", hidden_size=128, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, intermediate_size=384, vocab_size=2048, num_hidden_layers=2,
    total_ut_steps=4, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    torch_dtype="float32",
    wfd_draft_steps=2)  # the draft depth run.py uses for this model (see the README)
DEPTH_WEIGHTS = (0.1, 0.2, 0.3, 1.0)  # loss at every recurrence, so that shallow depths can draft
PROMPT_LEN = 48


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE, as GPT-2's: any text encodes, nothing is unknown."""
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok, texts):
    """All texts as one stream of token ids, each file followed by EOS."""
    eos = tok.token_to_id(EOS)
    return torch.tensor([t for enc in tok.encode_batch(texts) for t in enc.ids + [eos]])


def init_weights(model, seed):
    """Untied head at zero and input embeddings at std 1: with a small tied embedding the model
    stalled at unigram loss. Ouro normalises every sub-block's output, so plain 1/sqrt(fan_in)
    suffices for the matrices."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name == "embed.weight":
            p.data.copy_(torch.randn(p.shape, generator=g))
        elif name == "lm_head.weight":
            p.data.zero_()
        elif p.dim() == 2:
            p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        else:
            p.data.fill_(1.0)  # the RMSNorm weights


def depth_losses(model, x, y, shallow=None):
    """Cross-entropy (nats/token) of the prediction read out after each recurrence: [T]. The depths
    before the last are read out on the first `shallow` sequences of the batch only (default all):
    the head costs as much as a layer here, and a draft depth needs less signal than full depth."""
    pos = torch.arange(x.shape[-1])
    s, _ = model.P(x, pos)
    losses = []
    for d in range(model.num_steps):
        s = model.R(s, None, pos, d)
        b = len(x) if d == model.num_steps - 1 or shallow is None else shallow
        losses.append(F.cross_entropy(model.C(s[:b], None, pos).flatten(0, -2), y[:b].flatten()))
    return torch.stack(losses)


def train(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_texts = [text for _, text in library_split()[0]]
    if args.smoke:
        train_texts = train_texts[:20]
    t0 = time.time()
    tok = train_tokenizer(train_texts, 512 if args.smoke else CONFIG["vocab_size"])
    data = encode(tok, train_texts)
    print(f"{len(train_texts)} training files, {len(data):,} tokens, "
          f"{sum(map(len, train_texts)) / len(data):.2f} chars/token; tokenizer "
          f"{time.time() - t0:.0f}s")
    config = dict(CONFIG, vocab_size=tok.get_vocab_size())
    model = models.from_config(config).train().requires_grad_(True)
    init_weights(model, args.seed)
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if p.dim() < 2 or p is model.embed.weight]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1),
                             dict(params=rest, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95))
    n, steps = config["max_position_embeddings"], args.steps
    weights = torch.tensor(DEPTH_WEIGHTS)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(steps):
        # linear warmup, cosine decay to a tenth
        warm = min(steps // 10, 200)
        lr = args.lr * (step + 1) / warm if step < warm else args.lr * (
            0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - n - 1, (args.batch,), generator=g)
        chunk = torch.stack([data[i:i + n + 1] for i in starts])
        losses = depth_losses(model, chunk[:, :-1], chunk[:, 1:], shallow=max(1, args.batch // 2))
        loss = (losses * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"step {step:5d}  lr {lr:.2e}  CE per depth "
                  + " ".join(f"{v:.3f}" for v in losses.tolist())
                  + f"  {(step + 1) * args.batch * n / el:,.0f} tok/s  {el / 60:.1f} min",
                  flush=True)
    model.eval().requires_grad_(False)
    models.save(model, args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"saved {args.out} after {(time.time() - t0) / 60:.1f} min of training")


# -- evaluation ------------------------------------------------------------------------------------

def eval_prompts(tok, count=8, length=PROMPT_LEN):
    """The first `length` tokens from the first top-level def of the first `count` held-out
    library files."""
    prompts = []
    for _, text in library_split()[1]:
        i = text.find("\ndef ")
        if i >= 0:
            prompts.append(tok.encode(text[i + 1:]).ids[:length])
        if len(prompts) == count:
            break
    return prompts


def distinct_4grams(tokens):
    """Share of the token 4-grams that are distinct: 1.0 when nothing repeats, near 0 when one
    line (or one word) repeats over and over."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams)


def evaluate(args):
    torch.set_num_threads(args.threads)
    model = models.load(args.out)
    tok, T, n = model.tokenizer, model.num_steps, model.args.max_seq_len
    texts = [text for _, text in library_split()[1]]
    data = encode(tok, texts)
    chunks = data[:len(data) // (n + 1) * (n + 1)].view(-1, n + 1)
    with torch.no_grad():
        ce = (sum(len(c) * depth_losses(model, c[:, :-1], c[:, 1:]) for c in chunks.split(16))
              / len(chunks))
    bytes_per_token = sum(len(t.encode()) for t in texts) / len(data)
    print(f"{args.out}: torch {torch.__version__}\n")
    print(f"held-out library code: {len(texts)} files, {len(data):,} tokens, "
          f"{bytes_per_token:.2f} bytes/token\n")
    print("| depth | " + " | ".join(str(d + 1) for d in range(T)) + " |\n" + "|---" * (T + 1) + "|")
    print("| CE, nats/token | " + " | ".join(f"{v:.3f}" for v in ce.tolist()) + " |")
    print("| bits/byte | "
          + " | ".join(f"{v / math.log(2) / bytes_per_token:.3f}" for v in ce.tolist()) + " |")
    print(f"\nCE at depth 1 - CE at depth {T}: {ce[0] - ce[-1]:.3f} nats/token")

    texts = eval_prompts(tok, length=PROMPT_LEN + args.new_tokens)
    prompts, sources = [t[:PROMPT_LEN] for t in texts], [t[PROMPT_LEN:] for t in texts]
    set_threads(model)  # as run.py decodes it
    eos = model.config.get("eos_token_id")
    ar = [engine.generate(model, p, args.new_tokens, method="ar", eos_token_id=eos)
          for p in prompts]
    shares = [distinct_4grams(g.tokens) for g in ar]
    print(f"\ngreedy continuations of {len(prompts)} held-out prompts, {args.new_tokens} new "
          f"tokens: share of distinct token 4-grams: mean {statistics.mean(shares):.2f}, min "
          f"{min(shares):.2f} (the files' own continuations: mean "
          f"{statistics.mean(map(distinct_4grams, sources)):.2f})")
    for p, g, share in zip(prompts, ar, shares):
        print(f"  {share:.2f}  {tok.decode(p)[:36]!r} -> {tok.decode(g.tokens)[:56]!r}")
    print("\n--- prompt ---\n" + tok.decode(prompts[0]) + "\n--- greedy continuation ---\n"
          + tok.decode(ar[0].tokens))

    print(f"\nWFD vs AR: {args.new_tokens} new tokens on each of the {len(prompts)} prompts, the "
          f"faster of {args.repeats} interleaved runs of each, {torch.get_num_threads()} "
          "thread(s); speedup: median over the prompts\n")
    print("| k | acceptance a | speedup | ideal T / (a*k + (1-a)*T) | speedup / ideal "
          "| outputs identical to AR |")
    print("|---|---|---|---|---|---|")
    for k in range(1, T + 1):  # k = T drafts nothing: WFD is AR, and the ideal is 1
        speedups, accepted, verified, same = [], 0, 0, True
        for p, ref in zip(prompts, ar):
            best = {"ar": math.inf, "wfd": math.inf}
            for _ in range(args.repeats):  # interleaved, so that a busy spell hits both alike
                for method in ("ar", "wfd"):
                    g = engine.generate(model, p, args.new_tokens, method=method,
                                        draft_steps=k, eos_token_id=eos)
                    best[method] = min(best[method], g.stats["wall_s"])
                    same &= g.tokens == ref.tokens
            speedups.append(best["ar"] / best["wfd"])
            accepted += g.stats["accepted"]
            verified += g.stats["accepted"] + g.stats["rejected"]
        a = accepted / verified if verified else 0.0
        ideal = T / (a * k + (1 - a) * T)
        speedup = statistics.median(speedups)
        print(f"| {k} | {f'{a:.3f}' if verified else '-'} | {speedup:.2f}x | {ideal:.2f}x | "
              f"{speedup / ideal:.2f} | {'yes' if same else 'NO'} |",
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=HERE, help="model folder (default: demo/, this script's)")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps on a tiny slice, to test the script")
    p.add_argument("--eval", action="store_true",
                   help="measure the model in --out instead of training")
    p.add_argument("--steps", type=int, default=3600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2,
                   help="CPU threads for training and the loss evaluation")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch = 3, 2
    evaluate(args) if args.eval else train(args)


if __name__ == "__main__":
    main()
