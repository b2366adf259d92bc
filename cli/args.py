"""The flags run.py and bench.py share, and their one rule for errors: every mistake in the user's
input is one line on stderr and exit status 2 (Ctrl-C: one line and 130; a closed pipe, as in
`run.py ... | head`: nothing, and 141 as a process SIGPIPE ends); a traceback is a bug."""
import argparse
import contextlib
import functools
import os
import re
import signal
import sys
import threading

import torch

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
TOKENIZER_HELP = ("tokenizer.json, or a folder or hub id holding one, for a model whose folder has "
                  "none (Parcae: SandyResearch/parcae-tokenizer)")


class Parser(argparse.ArgumentParser):
    # one line, like every other error of the command line (no usage block)
    def error(self, message):
        self.exit(2, f"error: {message}\n")


# what frees memory: flags of both commands, and each one's own way to share the KV cache
MEMORY_HINT = ("; try a smaller --batch-size, --max-new-tokens or --dtype, or a KV cache shared "
               "across depths (run.py --kv shared, bench.py --methods wfd-shared)")


def one_line_errors(main):
    """main, with every error in the user's input (arguments, files, configs, weights, devices, the
    hub: the ValueErrors and OSErrors this project raises for them) and running out of memory
    reported as one line on stderr and exit status 2, and Ctrl-C as one line and status 130. A
    reader that closed the output (`| head`) ends it quietly, with the status a process SIGPIPE
    ends has (141). Any other exception is a bug, and keeps its traceback."""
    @functools.wraps(main)
    def wrapped(argv=None):
        if threading.current_thread() is threading.main_thread():  # the only one that may
            signal.signal(signal.SIGINT, signal.default_int_handler)  # see cli.interrupt_quietly
        try:
            return main(argv)
        except BrokenPipeError:
            # stdout's buffer cannot be written at exit either: point it at /dev/null
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except (ValueError, OSError) as err:
            print("error: " + in_flags(" ".join(str(err).split())), file=sys.stderr)
            sys.exit(2)
        except RuntimeError as err:
            oom = out_of_memory(err)
            if oom is None:
                raise
            print("error: out of memory: " + " ".join(str(oom).split("\n")[0].split())[:300]
                  + MEMORY_HINT, file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt as err:
            print(str(err) or "interrupted", file=sys.stderr)
            sys.exit(130)
    return wrapped


# generate()'s parameters as the flags that set them: its checks (engine/checks.py) name the
# parameter, the command line the flag the user typed
FLAGS = [(r"\bmax_new_tokens\b", "--max-new-tokens"), (r"\bnum_steps\b", "--steps"),
         (r"\bdraft_len\b", "--draft-len"), (r"\bsecond_depth\b", "--second-depth"),
         (r"\btop_k must be None or\b", "--top-k must be"), (r"\btop_k\b", "--top-k"),
         (r"\btop_p must be None or\b", "--top-p must be"), (r"\btop_p\b", "--top-p"),
         (r"^temperature\b", "--temperature"), (r"^seed must\b", "--seed must"),
         (r"^width\b", "--width"), (r"\bcapacity (\S+) must\b", r"--capacity \1 must"),
         (r"\bkv='(\w+)'", r"--kv \1"),
         (r": method '(\w+)' \(or '(\w+)',", r": --method \1 (or \2,"),
         (r"\bnot 'dtv'$", "not dtv")]


def in_flags(message):
    """A refusal in the words of the command line: each parameter named by its flag."""
    for pattern, flag in FLAGS:
        message = re.sub(pattern, flag, message)
    return message


@contextlib.contextmanager
def naming(flag, value):
    """Errors in reading what `flag` names (a file, a folder, a hub id) start with the flag, and
    with its value where they do not quote it: `--prompts-file x.bin: ...`. Others (the weights
    too large for the device) pass as they are."""
    try:
        yield
    except (ValueError, OSError) as err:
        text = " ".join(str(err).split())
        if isinstance(err, UnicodeDecodeError):
            text = f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})"
        elif isinstance(err, OSError) and err.strerror and err.filename:
            text = (err.strerror if os.path.normpath(err.filename) == os.path.normpath(value)
                    else f"{err.filename}: {err.strerror}")
        elif str(value) not in text or text.startswith("--"):
            raise
        text = f"{flag}: {text}" if str(value) in text else f"{flag} {value}: {text}"
        raise (OSError if isinstance(err, OSError) else ValueError)(text) from None


# what the messages of running out of memory say, whatever raised them: the CPU allocator, CUDA's
# caching allocator (torch.OutOfMemoryError), a kernel launch or a library's workspace
OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
                 "CUDNN_STATUS_ALLOC_FAILED")


def out_of_memory(err):
    """The exception that says memory ran out, when `err` is one or wraps one (torch.compile's
    BackendCompilerFailed and InductorError hold theirs as inner_exception, others as their
    cause): torch.OutOfMemoryError, or a RuntimeError whose message says so ("CUDA error: out
    of memory" from a kernel, cuBLAS failing to allocate its workspace), the innermost one. None
    otherwise."""
    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    for err in reversed(chain):  # the innermost first: a wrapper's message repeats its inner one's
        if isinstance(err, torch.OutOfMemoryError) or (
                isinstance(err, RuntimeError) and any(m in str(err) for m in OUT_OF_MEMORY)):
            return err
    return None


def check_at_least(args, **least):
    """Refuse a count below its minimum (--threads -2 and the like) before any work starts."""
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, not {value}")


def refuse_engine_only(args, *flags):
    """--engine reference runs wfd.py's loop, greedy and one prompt at a time: each of these flags,
    given (not at its default), is the engine's alone."""
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in (None, False, 0):
            raise ValueError(f"{flag} is the engine's: --engine reference runs wfd.py's plain "
                             "loop (greedy, one prompt); leave --engine at its default")


def add_decoding_args(p, seed_help, dtype_help, compile_help):
    """The flags run.py and bench.py share: depths, drafts, precision, threads,
    compiling, sampling."""
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, help="full depth T (default: the model's)")
    p.add_argument("--draft-steps", type=int, help="draft depth k (default: the config's "
                   "wfd_draft_steps at the model's own T; at any other --steps, and for a config "
                   "without one, max(1, T // 8): the demo's 2 at T=4, 1 at --steps 8)")
    p.add_argument("--draft-len", type=int, default=4, help="drafts per draft-then-verify round")
    p.add_argument("--second-depth", type=int, metavar="M", help="the wavefront's second proposal: "
                   "each row read again at depth M (k < M < T), a sibling started where it "
                   "disagrees with the draft (docs/siblings.md)")
    p.add_argument("--device", default="cpu", type=device, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), help=dtype_help)
    p.add_argument("--threads", type=int, help="CPU threads (default: 1 for models under 100M "
                   "parameters, whose matmuls are too small to share between cores; else "
                   "torch's default)")
    p.add_argument("--compile", action="store_true", help="run the P, R and C calls after the "
                   "prefill compiled by torch.compile (on CUDA as CUDA graphs, the default there); "
                   + compile_help)
    p.add_argument("--eager", action="store_true", help="on CUDA, run the calls without compiling "
                   "them (on a CPU the default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else "
                   "sample (every method gives AR's sampled tokens with the same seed)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float,
                   help="sample from the most likely tokens that reach probability p")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def device(text):
    """--device: cpu, cuda, or one of several GPUs, cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N")
    return text


def resolve_compile(args):
    """--compile and --eager: compiled on CUDA unless --eager (eager, every call is thousands of
    kernel launches, and the GPU waits for the host), eager on a CPU unless --compile. CUDA: any
    of its devices (cuda, cuda:1)."""
    if args.compile and args.eager:
        raise ValueError("--compile and --eager contradict each other: give one")
    args.compile = args.compile or (torch.device(args.device).type == "cuda" and not args.eager)


def compiling_line(graphs, seconds, device):
    """What the commands say once they have compiled, on stderr."""
    return (f"compiled {graphs} graphs in {seconds:.1f} s (torch.compile"
            + (", CUDA graphs; --eager runs without" if device.type == "cuda" else "") + ")")


def set_threads(model, threads=None):
    """`threads` CPU threads, or one for a model under 100M parameters: its matmuls are too small to
    gain from more, and lose a lot when another process holds a core."""
    if threads or sum(p.numel() for p in model.parameters()) < 100e6:
        torch.set_num_threads(threads or 1)
