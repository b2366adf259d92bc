"""generate()'s arguments, checked and resolved before anything runs: each refusal names the
problem. run.py and bench.py call check_args too, so that bad input is refused before anything
is printed."""
import math
import numbers
from typing import NamedTuple, Optional

import torch

from engine import kv_cache
from engine.sampling import Sampling
from wfd import default_draft_steps


def prompt_list(prompt_ids):
    """The prompt as a list of Python ints. Takes a list or tuple of ints, a 1-D integer tensor or
    array, or the one row of a [1, n] one; refuses what would otherwise be silently reinterpreted
    (text, floats and bools cast to ids, several prompts run as one)."""
    if hasattr(prompt_ids, "ids"):
        raise TypeError("the prompt is a tokenizers Encoding: pass its .ids")
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("the prompt must be token ids, not text: encode it with the "
                        "model's tokenizer")
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() == 2 and len(ids) == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError("the prompt must be one sequence of token ids (shape [n] or [1, n]), not "
                         f"shape {list(ids.shape)}: pass several prompts as a list of them, each "
                         "its own length")
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise TypeError("prompt token ids must be integers, not "
                        f"{str(ids.dtype).replace('torch.', '')}")
    return ids.tolist()


def prompt_lists(prompt_ids):
    """(prompts as lists of ints, batched): one prompt (prompt_list) or a list or tuple of them,
    each error naming the prompt's index."""
    # an id, or not one
    scalar = lambda t: isinstance(t, numbers.Number) or getattr(t, "ndim", None) == 0
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids or all(map(scalar, prompt_ids)):
        return [prompt_list(prompt_ids)], False
    prompts = []
    for i, p in enumerate(prompt_ids):
        if scalar(p):
            raise TypeError(f"prompt {i} is a token id among prompts: pass one prompt (a list of "
                            "ids) or a list of prompts, not a mix")
        try:
            prompts.append(prompt_list(p))
        except (TypeError, ValueError) as err:
            raise type(err)(f"prompt {i}: {err}") from None
    return prompts, True


def stop_ids(eos_token_id, vocab_size):
    """The stop tokens as a frozenset: eos_token_id is None (none), an int, or a collection of ints
    (a real checkpoint has several: end of text, end of turn)."""
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else eos_token_id
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError("eos_token_id must be None, a token id or a collection of token ids, "
                         f"not {eos_token_id!r}")
    ids = list(ids)
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"eos_token_id holds {t!r}, which is not a token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"eos_token_id {t} is outside the vocabulary (0..{vocab_size - 1})")
    return frozenset(int(t) for t in ids)


def check_args(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
               draft_len=4, width=None, capacity=None, eos_token_id=None, kv="full", window=None,
               temperature=0.0, top_k=None, top_p=None, seed=0, batch_size=None, compile=False,
               second_depth=None):
    """generate()'s arguments checked and normalized: (the prompt as a list of ints, or several as a
    list of them, max_new_tokens as an int, T, k, width, window, the stop tokens as a frozenset).
    run.py calls it too, so that bad input is refused before anything is printed."""
    prompts, batched = prompt_lists(prompt_ids)
    for i, prompt in enumerate(prompts):
        try:
            check_prompt(model, prompt, max_new_tokens, capacity)
        except (TypeError, ValueError) as err:
            raise type(err)(f"prompt {i}: {err}" if batched else str(err)) from None
    several = isinstance(seed, (list, tuple))
    if several and (not batched or len(seed) != len(prompts)):
        raise ValueError(f"{len(seed)} seeds for {len(prompts) if batched else 'one'} prompt(s): "
                         "give one seed, or a list of prompts and one seed each")
    seeds = seed if several else [seed]
    for s in seeds:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError("seed must be an integer >= 0 (or, for several prompts, a list of "
                             f"them), not {s!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1, not {batch_size!r}")
    T = model.num_steps if num_steps is None else num_steps
    k = default_draft_steps(model, num_steps) if draft_steps is None else draft_steps
    if method not in ("ar", "wfd", "dtv"):
        raise ValueError(f"method must be 'ar', 'wfd' or 'dtv', not {method!r}")
    if kv not in ("full", "shared"):
        raise ValueError(f"kv must be 'full' or 'shared', not {kv!r}")
    if T < 1:
        raise ValueError(f"num_steps must be at least 1, not {T}")
    if not 1 <= k <= T:
        raise ValueError(f"draft depth {k} is out of range: it must be in 1..{T} (the full depth)")
    if draft_len < 1:
        raise ValueError(f"draft_len must be at least 1, not {draft_len}")
    wave = math.ceil(T / k)  # the wavefront's rows in flight
    if second_depth is not None:
        m = second_depth
        if not isinstance(m, int) or isinstance(m, bool) or not k < m < T:
            raise ValueError(f"second depth {m!r} is out of range: it must lie between the draft "
                             f"depth {k} and the full depth {T} (k < m < T)")
        if method == "dtv":
            raise ValueError("second_depth is the wavefront's second proposal: method 'wfd' (or "
                             "'ar', its exact reference through the same calls), not 'dtv'")
    need = wave if method == "wfd" else draft_len + 1 if method == "dtv" else 1
    default = sibling_width(T, k, second_depth) if second_depth is not None else wave
    width = (draft_len + 1 if method == "dtv" else default) if width is None else width
    if not isinstance(width, int) or width < need:
        raise ValueError(f"width {width!r} is too small: {method} needs at least {need} rows "
                         "per call")
    if kv == "full" and window is not None:
        raise ValueError("window only applies to kv='shared'")
    if kv == "shared":
        if method == "dtv":
            raise ValueError("kv='shared' is not exact for draft-then-verify: its verify pass "
                             "writes the final-depth KV of positions it may then reject, which "
                             "rows in flight read; use kv='full'")
        window = wave if window is None else window
        if window < (wave if method == "wfd" else 1):
            raise ValueError(f"window {window} is narrower than the wavefront (ceil(T/k) = {wave} "
                             "rows): its rows would read final-depth KV that is not written yet")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError("temperature must be a finite number >= 0 (0: greedy), "
                         f"not {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, not {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], not {top_p!r}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError("top_k and top_p need temperature > 0: greedy decoding has nothing "
                         "to filter")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, not {compile!r}")
    return (prompts if batched else prompts[0], int(max_new_tokens), T, k, width, window,
            stop_ids(eos_token_id, model.args.vocab_size))


def sibling_width(T, k, m):
    """The second proposal's default width: the wavefront's ceil(T / k) rows, and the rows of the
    branch a sibling grows before its parent is verified, ceil((T - m) / k) (fewer lanes only
    start fewer rows: a row never waits for one)."""
    return math.ceil(T / k) + math.ceil((T - m) / k)


def check_prompt(model, prompt, max_new_tokens, capacity):
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an integer, not {max_new_tokens!r}")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < model.args.vocab_size]
    if bad:
        raise ValueError(f"prompt token {bad[0]} is outside the vocabulary "
                         f"(0..{model.args.vocab_size - 1})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
    if len(prompt) + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context of {model.args.max_seq_len} positions")
    if (capacity is not None
            and not len(prompt) + max_new_tokens - 1 <= capacity <= model.args.max_seq_len):
        raise ValueError(f"capacity {capacity} must hold the prompt and the new tokens but the "
                         f"last ({len(prompt) + max_new_tokens - 1}) and fit the model's "
                         f"context ({model.args.max_seq_len})")


class Plan(NamedTuple):
    """generate's arguments resolved: what its Decoder and Sequences are built from."""
    prompts: list            # the prompts as lists of ids
    batched: bool            # prompt_ids was a list of prompts
    max_new_tokens: int
    num_steps: int           # T
    draft_steps: int         # k
    width: int
    window: Optional[int]
    stop: frozenset
    seeds: list              # one per prompt
    slots: int
    capacity: int            # KV positions per sequence
    sampling: Sampling


def plan(model, prompt_ids, max_new_tokens, *, capacity=None, seed=0, batch_size=None,
         compile=False, temperature=0.0, top_k=None, top_p=None, **kw):
    """check_args, then the slots (one per prompt, at most batch_size) and the KV capacity (the
    longest prompt's positions; compiled, rounded up: compiled_capacity)."""
    prompts, max_new_tokens, T, k, width, window, stop = check_args(
        model, prompt_ids, max_new_tokens, capacity=capacity, seed=seed, batch_size=batch_size,
        compile=compile, temperature=temperature, top_k=top_k, top_p=top_p, **kw)
    batched = isinstance(prompts[0], list)
    prompts = prompts if batched else [prompts]
    seeds = seed if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    positions = max(map(len, prompts)) + max_new_tokens - 1
    capacity = capacity or (compiled_capacity(model, positions) if compile else positions)
    return Plan(prompts, batched, max_new_tokens, T, k, width, window, stop, seeds,
                min(batch_size or len(prompts), len(prompts)), capacity,
                Sampling(temperature, top_k, top_p))


def compiled_capacity(model, positions):
    """Compiled decoding's default capacity: a power of two of at least one key block, so that
    prompts of many lengths share a few caches and their graphs (attention reads only the
    written blocks)."""
    return min(model.args.max_seq_len, max(kv_cache.BLOCK, 1 << (positions - 1).bit_length()))
