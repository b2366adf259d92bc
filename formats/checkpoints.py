"""The checkpoint formats: where each family keeps its tensors (layouts), reading a checkpoint from
a folder or the hub with every name, shape and value checked, and writing one in the
official layout.

    Ouro, Huginn   config.json (model_type) + safetensors (one file or shards with an index); the
                   Raven retrofits share Huginn's model_type and names, told apart by their tensors
    LoopFormer     the same, its keys prefixed `gpt.`; its config leaves out the sizes (defaults)
                   and the iteration count (the repo id's)
    Parcae         config.json (the dump of ParcaeConfig, named by _class_name) + pytorch_model.bin
                   (or model.pt), a torch pickle read with weights_only; its tokenizer lives in
                   its own repo

models.load and models.save are the API; this module knows the model only by its attributes.
"""
import json
import os
import pickle
import re
import sys
from contextlib import contextmanager

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from formats import configs

# Block's, in the checkpoints' order
NORMS = ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
# the floating dtypes of the safetensors header
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
                      "F16": torch.float16}
# Parcae's weights: the hub's file name, then its repo's
PICKLES = ("pytorch_model.bin", "model.pt")


def _blocks(a):
    """(our prefix, the checkpoint's prefix) of every block of Huginn, the retrofits and Parcae,
    prelude first."""
    groups = (("prelude", "prelude", a.n_prelude), ("core", "core_block", a.n_core),
              ("coda", "coda", a.n_coda))
    return [(f"{ours}.{i}.", f"transformer.{theirs}.{i}.") for ours, theirs, n in groups
            for i in range(n)]


def checkpoint_layout(a):
    """Our parameter name -> [(checkpoint key, rows)]: fused parameters are concatenations of
    several checkpoint tensors along dim 0. Also returns the checkpoint keys we may find but do not
    use, and the key of the stored RoPE table (None: computed)."""
    qkv = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
    layout, unused, rope = {}, set(), "freqs_cis"
    if a.kind == "ouro":
        for i in range(a.n_core):
            src, dst = f"model.layers.{i}.", f"core.{i}."
            layout[dst + "qkv.weight"] = [(src + f"self_attn.{n}_proj.weight", r)
                                          for n, r in zip("qkv", qkv)]
            layout[dst + "proj.weight"] = [(src + "self_attn.o_proj.weight", None)]
            layout[dst + "fc.weight"] = [(src + "mlp.gate_proj.weight", a.hidden_dim),
                                         (src + "mlp.up_proj.weight", a.hidden_dim)]
            layout[dst + "down.weight"] = [(src + "mlp.down_proj.weight", None)]
            for ours, theirs in zip(NORMS, ["input_layernorm", "input_layernorm_2",
                                            "post_attention_layernorm",
                                            "post_attention_layernorm_2"]):
                layout[dst + ours] = [(src + theirs + ".weight", None)]
        layout["embed.weight"] = [("model.embed_tokens.weight", None)]
        layout["norm"] = [("model.norm.weight", None)]
        # always full depth
        unused, rope = {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}, None
    elif a.kind in ("huginn", "retrofit"):
        # the block's norms in order are the checkpoint's norm_1, norm_2, ...: Huginn's four, a
        # Llama retrofit's input norms, an OLMo-2 retrofit's output norms
        norms = [n for n, on in zip(NORMS, (a.in_norm, a.sandwich) * 2) if on]
        for dst, src in _blocks(a):
            layout[dst + "qkv.weight"] = [(src + "attn.Wqkv.weight", None)]
            layout[dst + "proj.weight"] = [(src + "attn.proj.weight", None)]
            layout[dst + "fc.weight"] = [(src + "mlp.fc.weight", None)]
            layout[dst + "down.weight"] = [(src + "mlp.proj.weight", None)]
            if a.qk_bias:
                layout[dst + "qk_bias"] = [(src + "attn.qk_bias", None)]
            if a.qk_proj_norm:
                layout[dst + "q_norm"] = [(src + "attn.q_norm.weight", None)]
                layout[dst + "k_norm"] = [(src + "attn.k_norm.weight", None)]
            for n, ours in enumerate(norms, 1):
                layout[dst + ours] = [(src + f"norm_{n}.weight", None)]
        layout["embed.weight"] = [("transformer.wte.weight", None)]
        layout["adapter.weight"] = [("transformer.adapter.weight", None)]
        layout["norm"] = [("transformer.ln_f.weight", None)]
        rope = "freqs_cis" if a.kind == "huginn" else None  # the retrofits compute theirs
    elif a.kind == "loopformer":
        _loopformer_layout(a, layout)
        unused, rope = {"gpt.lm_head.weight"}, None  # the tied head, should a file hold it
    else:
        _parcae_layout(a, layout, unused)
    if a.tie_embeddings:  # Huginn's and Parcae's files hold the tied head a second time
        unused.add("lm_head.weight")
    else:
        layout["lm_head.weight"] = [("lm_head.weight", None)]
    return layout, unused, rope


def _loopformer_layout(a, layout):
    for j in range(a.n_core):
        src, dst = f"gpt.transformer.h.blocks.{j}.", f"core.{j}."
        for ours, theirs in (("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("fc", "mlp.c_fc"),
                             ("down", "mlp.c_proj"), ("ada", "adaLN_modulation.1")):
            layout[f"{dst}{ours}.weight"] = [(f"{src}{theirs}.weight", None)]
        layout[dst + "ada.bias"] = [(src + "adaLN_modulation.1.bias", None)]
    layout["embed.weight"] = [("gpt.transformer.wte.weight", None)]
    layout["pos_embed.weight"] = [("gpt.transformer.wpe.weight", None)]
    layout["norm"] = [("gpt.transformer.norm_f.weight", None)]
    for ours, theirs in (("time", "time_embedder"), ("step", "dt_embedder")):
        for i in (0, 2):  # the MLP is (Linear, SiLU, Linear)
            for p in ("weight", "bias"):
                layout[f"clock.{ours}.{i}.{p}"] = [(f"gpt.{theirs}.mlp.{i}.{p}", None)]


def _parcae_layout(a, layout, unused):
    mixing = a.value_embeds
    for k, (dst, src) in enumerate(_blocks(a)):
        layout[dst + "qkv.weight"] = [(src + f"attn.c_{n}.weight", r) for n, r in zip("qkv", [
            a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim])]
        layout[dst + "proj.weight"] = [(src + "attn.c_proj.weight", None)]
        layout[dst + "fc.weight"] = [(src + "mlp.fc.weight", None)]
        layout[dst + "down.weight"] = [(src + "mlp.proj.weight", None)]
        layout[dst + "attn_norm"] = [(src + "norm_1.weight", None)]
        layout[dst + "mlp_norm"] = [(src + "norm_2.weight", None)]
        if k in mixing:
            layout[dst + "ve_gate.weight"] = [(src + "attn.ve_gate.weight", None)]
        # a gate without its table: the official code ignores it, and so do we
        elif k in a.ve_gates:
            unused.add(src + "attn.ve_gate.weight")
    if mixing:
        layout["value_embed"] = [(f"value_embeds.{k}.weight", a.vocab_size) for k in mixing]
    # tables without a gate
    unused.update(f"value_embeds.{k}.weight" for k in a.ve_tables if k not in mixing)
    layout["embed.weight"] = [("transformer.wte.weight", None)]
    for name in ("A_log", "dt_bias", "B"):
        layout["adapter." + name] = [("transformer.adapter." + name, None)]
    layout["coda_in.weight"] = [("transformer.C.weight", None)]
    layout["norm"] = [("transformer.ln_f.weight", None)]
    if a.prelude_norm:
        layout["prelude_norm"] = [("transformer.ln_prelude.weight", None)]


HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def resolve(source, files=HUB_FILES, what="model folder"):
    """A local folder, or a hub id fetched with huggingface_hub (`files`: by default config,
    weights, tokenizer only). A name that can only be a path (./x, /x, ~/x, a/b/c) is never sent to
    the hub."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"{source} is a file, not a model folder (one holding config.json "
                                "and the weights)")
    if not re.fullmatch(r"\w[\w.-]*(/\w[\w.-]*)?", source):
        raise FileNotFoundError(f"no such {what}: {source}")
    from huggingface_hub import snapshot_download
    try:
        folder = snapshot_download(source, allow_patterns=files)
        if files is HUB_FILES and not any(n.endswith(".safetensors") for n in os.listdir(folder)):
            # no safetensors: Parcae's torch pickle, fetched only then (a repo may hold
            # both formats)
            folder = snapshot_download(source, allow_patterns=list(PICKLES))
        return folder
    except Exception as err:
        raise ConnectionError(hub_error(source, err)) from err


def hub_error(source, err):
    """One line for a hub id that could not be fetched: which id, why (the hub cannot be reached,
    or it has no such repo), and how to give a local folder instead."""
    from huggingface_hub import errors
    local = ("; download it on a machine that reaches the hub (hf download "
             f"{source}) and give the local folder's path instead of the id")
    unreachable = (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, ConnectionError,
                   TimeoutError)
    if isinstance(err, errors.RepositoryNotFoundError) and not isinstance(err,
                                                                         errors.GatedRepoError):
        return (f"could not get {source!r} from the Hugging Face hub: no such repository (or a "
                "private one), and no local folder has that name: check the id" + local)
    if isinstance(err, unreachable) or "Connect" in type(err).__name__:
        return (f"could not get {source!r} from the Hugging Face hub: the hub cannot be reached "
                "from here (offline, or HF_HUB_OFFLINE set), and no local folder has that name"
                + local)
    first = " ".join(str(err).split("\n")[0].split())[:200]
    return (f"could not get {source!r} from the Hugging Face hub ({type(err).__name__}: {first}), "
            "and no local folder has that name" + local)


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
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and t >= 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of token ids, "
                         f"not {eos!r}")
    return tuple(ids)


def read_chat_files(model, folder):
    """tokenizer_config.json, the chat template (chat_template.jinja where the checkpoint has one,
    as Hugging Face reads it, else tokenizer_config.json's) and the stop ids
    (generation_config.json's, else config.json's), onto the model."""
    path = os.path.join(folder, "tokenizer_config.json")
    model.tokenizer_config = read_json(path) if os.path.exists(path) else {}
    template = model.tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            template = f.read()
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}: the chat template is not a string")
    model.chat_template = template
    path = os.path.join(folder, "generation_config.json")
    generation = read_json(path) if os.path.exists(path) else {}
    if "eos_token_id" in generation and model.args.config_stop_ids:
        model.eos_token_ids = stop_tokens(generation, path)


def tokenizer_stop_ids(model):
    """The stop id of a checkpoint whose configs name none (LoopFormer) or stale ones (the
    retrofits carry huginn-0125's, of another vocabulary): tokenizer_config.json's eos_token, else
    GPT-2's <|endoftext|> (LoopFormer's tokenizer, OLMo-2's), as the tokenizer spells it."""
    eos = model.tokenizer_config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    ids = [model.tokenizer.token_to_id(t) for t in (eos, "<|endoftext|>") if isinstance(t, str)]
    return tuple(i for i in ids if i is not None)[:1]


def load_tokenizer(source):
    """A tokenizer.json: the file itself, or the one in a folder or a hub repo (Parcae's tokenizer
    has a repo of its own, SandyResearch/parcae-tokenizer)."""
    path = os.path.expanduser(source)
    if not os.path.isfile(path):
        path = os.path.join(resolve(source, ["tokenizer.json"], "tokenizer file or folder"),
                            "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {source}")
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{path} is not a tokenizer.json that tokenizers can "
                         f"read: {err}") from None


class Checkpoint:
    """A checkpoint folder (or hub id) opened: its config, and its tensors by name, read when asked
    for. models.load builds the model of the config, then load_into fills it."""

    def __init__(self, source):
        self.folder = resolve(source)
        path = os.path.join(self.folder, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json in {self.folder}")
        self.config = read_json(path)
        if self.config.get("model_type") == "loopformer" and "max_model_loops" not in self.config:
            loops = configs.iterations_in_name(source, self.folder)  # else the default, 8
            self.config = dict(self.config, **{"max_model_loops": loops} if loops else {})
        self.weights = Weights(self.folder)  # its names tell huginn-0125 from a retrofit

    def dtype(self, a):
        """The dtype of the checkpoint's embedding (a ModelArgs' family), float32 where it
        has none."""
        key = checkpoint_layout(a)[0]["embed.weight"][0][0]
        return self.weights.dtype(key) if key in self.weights.keys() else torch.float32

    def load_into(self, model):
        """The chat files, the weights (every tensor checked: name, shape, finite values; damaged
        weights would otherwise decode to garbage, as argmax of NaN logits is token 0) and
        the tokenizer."""
        folder, weights, a = self.folder, self.weights, model.args
        read_chat_files(model, folder)  # before the weights: a damaged file is named in seconds
        layout, unused, rope = checkpoint_layout(a)
        expected = ({k for parts in layout.values() for k, _ in parts} | unused
                    | ({rope} if rope else set()))
        missing = sorted(expected - unused - weights.keys())
        if missing:
            raise ValueError(f"checkpoint {folder} lacks tensor {missing[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        unexpected = sorted(weights.keys() - expected)
        if unexpected:
            raise ValueError(f"unexpected tensor {unexpected[0]!r} in {folder} for a {a.kind} "
                             "model of this config"
                             + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1
                                else ""))
        params = dict(model.named_parameters())
        # worth a progress bar (on a terminal)
        big = sum(os.path.getsize(path) for path in weights.paths) > 1e9
        for name, parts in tqdm(layout.items(), desc=f"loading {folder}", unit="tensor",
                                file=sys.stderr, disable=None if big else True):
            p, row = params[name], 0
            for key, rows in parts:
                want = (rows or p.shape[0],) + tuple(p.shape[1:])
                t = weights.read(key)
                if tuple(t.shape) != want:
                    raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)}, expected {want}")
                p.data[row:row + want[0]].copy_(t)
                row += want[0]
        if rope:  # the stored RoPE table is what the reference uses: cos [..., 0], sin [..., 1]
            t = weights.read(rope)
            want = (1, a.max_seq_len, 1, a.head_dim // 2, 2)
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {rope!r} has shape {tuple(t.shape)}, expected {want}")
            model.rope_cos, model.rope_sin = (t[0, :, 0, :, i].float().to(model.device)
                                              for i in (0, 1))
        tok_path = os.path.join(folder, "tokenizer.json")
        if os.path.exists(tok_path):
            model.tokenizer = load_tokenizer(tok_path)
            if not a.config_stop_ids:
                model.eos_token_ids = tokenizer_stop_ids(model)


def _weight_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        names = ["model.safetensors"]
    else:  # a pickle before other safetensors files (the golden folders hold golden.safetensors)
        names = ([n for n in PICKLES if os.path.exists(os.path.join(folder, n))][:1]
                 or sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")))
    if not names:
        raise FileNotFoundError(f"no weights in {folder}: no *.safetensors, and no "
                                f"{' or '.join(PICKLES)}")
    paths = [os.path.join(folder, n) for n in names]
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"weight file {path} named by the index is missing")
    return paths


class Weights:
    """A checkpoint's tensors by name, each read when asked for: from safetensors files, or from a
    torch pickle mapped into memory (mmap), never loaded whole."""

    def __init__(self, folder):
        self.paths = _weight_files(folder)
        self.file, self.pickled = {}, {}
        for path in self.paths:
            if path.endswith(".safetensors"):
                with _open(path) as f:
                    self.file.update((k, path) for k in f.keys())
            else:
                self.pickled = _load_pickle(path)
                self.file.update((k, path) for k in self.pickled)

    def keys(self):
        return self.file.keys()

    def dtype(self, key):
        """A tensor's dtype, from the safetensors header (or the mapped pickle), without reading
        it."""
        if key in self.pickled:
            return self.pickled[key].dtype
        with _open(self.file[key]) as f:
            name = f.get_slice(key).get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {key!r} in {self.file[key]} has dtype {name}, which a looped "
                             "LM's weights cannot have")
        return SAFETENSORS_DTYPES[name]

    def read(self, key):
        if key in self.pickled:
            t = self.pickled[key]
        else:
            with _open(self.file[key]) as f:
                t = f.get_tensor(key)
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {key!r} in {self.file[key]} holds NaN or inf: the weights "
                             "are damaged")
        return t


@contextmanager
def _open(path):
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or "
                         f"damaged?): {err}") from None


def _load_pickle(path):
    """A torch.save state dict, unpickled with weights_only: a pickle can run code, and weights_only
    builds tensors and plain containers only, refusing everything else."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            # the pre-zip format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if "Weights only load failed" in str(err):
            raise ValueError(f"{path} holds more than tensors "
                             f"({refused.group(1) if refused else 'an object'}), which "
                             "weights_only loading refuses: a pickle can run code; this one is "
                             "not loaded") from None
        raise ValueError(f"{path} is not a readable torch checkpoint: {err}") from None
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{path} is not a readable torch checkpoint (truncated or damaged?): "
                         f"{str(err).splitlines()[0]}") from None
    if not (isinstance(state, dict)
            and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())):
        raise ValueError(f"{path} does not hold a state dict (tensors by name)")
    return state


def save(model, folder):
    """Write config.json and the weights in the family's official layout (what load() reads):
    model.safetensors, or Parcae's pytorch_model.bin (a torch.save state dict)."""
    os.makedirs(folder, exist_ok=True)
    layout, _, rope = checkpoint_layout(model.args)
    params, tensors = dict(model.named_parameters()), {}
    for name, parts in layout.items():
        p, row = params[name].detach(), 0
        # each a copy of its own: torch.save would write a view's whole storage
        for key, rows in parts:
            tensors[key] = p[row:row + (rows or p.shape[0])].to("cpu", copy=True)
            row += rows or p.shape[0]
    if model.kind == "ouro":  # the official code requires the (unused) exit gate
        tensors["model.early_exit_gate.weight"] = torch.zeros(1, model.args.dim, dtype=model.dtype)
        tensors["model.early_exit_gate.bias"] = torch.zeros(1, dtype=model.dtype)
    if rope:
        tensors[rope] = torch.stack([model.rope_cos, model.rope_sin], -1)[None, :, None].cpu()
    if model.args.tie_embeddings and model.kind in ("huginn", "parcae"):
        # the official files hold the tied head twice: Parcae's one tensor under both names;
        # safetensors, which refuses shared tensors, a copy
        wte = tensors["transformer.wte.weight"]
        tensors["lm_head.weight"] = wte if model.kind == "parcae" else wte.clone()
    if model.kind == "parcae":
        torch.save(tensors, os.path.join(folder, PICKLES[0]))
    else:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config, f, indent=2)
