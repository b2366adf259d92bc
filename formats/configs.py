"""The families' config.json files read into the fields of models.ModelArgs: each key the official
code reads, with its default where the hub's configs leave it out, and every setting the official
code has and this one does not refused by name (a config is never run as another model).

A family is named by config.json's model_type (Hugging Face configs) or, for Parcae's dump of its
config class, by _class_name. model_type huginn_raven holds huginn-0125 and the Raven retrofits,
which their configs cannot tell apart: the checkpoint's tensor names do (raven_layout)."""
import math
import re
from functools import partial

SUPPORTED = {"ouro": "Ouro (ByteDance/Ouro-1.4B, Ouro-2.6B)",
             "huginn_raven": "Huginn (tomg-group-umd/huginn-0125) and the Raven retrofits "
                             "(smcleish/Recurrent-*-train-recurrence-32)",
             "ParcaeConfig": "Parcae (SandyResearch/parcae-140m ... parcae-1.3b)",
             "loopformer": "LoopFormer (armenjeddi/LoopFormer-3block-8iterations ...)"}
RAVEN_LAYOUTS = ("huginn", "llama", "olmo2")  # huginn-0125; the Llama/TinyLlama, OLMo-2 retrofits
# LoopFormer's config.json on the hub names no size: the official config class's defaults
LOOPFORMER_DEFAULTS = dict(block_size=1024, vocab_size=50304, n_layer=3, n_head=32, n_embd=2048,
                           intermediate_dim=5120, max_model_loops=8)
UNSUPPORTED = {  # key: the values this implementation runs
    "ouro": {"rope_scaling": lambda v: v is None, "use_sliding_window": lambda v: not v,
             "hidden_act": lambda v: v == "silu"},
    "huginn_raven": {"injection_type": lambda v: v == "linear",
                     "nonlin_name": lambda v: v == "SiLU", "bias": lambda v: not v,
                     "test_time_noise": lambda v: not v,
                     "rope_scaling": lambda v: not v or "llama3" in (v.get("rope_type"),
                                                                     v.get("type")),
                     "wfd_layout": lambda v: v in RAVEN_LAYOUTS},
    "ParcaeConfig": {"injection_type": lambda v: v == "diagonal",
                     "block_class_name": lambda v: v == "TransformerPreNormBlock",
                     "norm_class_name": lambda v: v == "RMSNorm",
                     "mlp_class_name": lambda v: v == "BaseMLP",
                     "nonlin_name": lambda v: v == "ReLU2",
                     "bias": lambda v: not v, "qk_bias": lambda v: not v,
                     "clip_qkv": lambda v: v is None, "logit_softcap": lambda v: v is None,
                     # other init strategies scale the embedding or the logits, and change
                     # like-init's sigma
                     "init_strategy": lambda v: v == "scaled-zero",
                     "mup_model_scaling_factor": lambda v: v == 1,
                     "state_init": lambda v: v in ("like-init", "zero"),
                     "rope_settings": lambda v: not v or v.get("use_rope", True)
                     and v.get("rope_condense_ratio", 1) == 1},
    "loopformer": {"bias": lambda v: not v},
}


def model_args(c: dict, keys=None) -> dict:
    """ModelArgs' fields for config c, or a ValueError naming what is unknown, unsupported or
    missing. keys: the checkpoint's tensor names, where known (raven_layout)."""
    key = "model_type" if "model_type" in c or "_class_name" not in c else "_class_name"
    family = c.get(key)
    if family not in SUPPORTED:
        raise ValueError(f"unknown {key} {family!r} in config.json; supported: "
                         + ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED.items()))
    bad = [f"{k}={c[k]!r}" for k, ok in UNSUPPORTED[family].items() if k in c and not ok(c[k])]
    if bad:
        raise ValueError("config.json asks for what this implementation does not support: "
                         + ", ".join(bad))
    if family == "huginn_raven" and raven_layout(c, keys) != "huginn":
        family = "retrofit"
    try:
        return dict(ouro=ouro, huginn_raven=huginn, ParcaeConfig=parcae, loopformer=loopformer,
                    retrofit=partial(retrofit, olmo2=raven_layout(c, keys) == "olmo2"))[family](c)
    except KeyError as err:
        raise ValueError(f"config.json lacks {err.args[0]!r}, needed for a {family} model") \
            from None


def ouro(c):
    heads = c["num_attention_heads"]
    return dict(
        kind="ouro", dim=c["hidden_size"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, hidden_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"], n_prelude=0, n_core=c["num_hidden_layers"], n_coda=0,
        num_steps=c.get("total_ut_steps", 4), rope_theta=float(c.get("rope_theta", 1e6)),
        norm_eps=c.get("rms_norm_eps", 1e-6), max_seq_len=c["max_position_embeddings"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        inject=False, norm_each_step=True, post_norm=False, interleaved_rope=False, embed_scale=1.0)


def huginn(c):
    dim, heads = c["n_embd"], c["n_heads"]
    return dict(
        kind="huginn", dim=dim, n_heads=heads, n_kv_heads=heads,  # MHA, forced by its config class
        head_dim=dim // heads, hidden_dim=c["intermediate_size"],
        vocab_size=c.get("padded_vocab_size") or c["vocab_size"],
        n_prelude=c["n_layers_in_prelude"], n_core=c["n_layers_in_recurrent_block"],
        n_coda=c["n_layers_in_coda"], num_steps=c.get("mean_recurrence", 32),
        rope_theta=float(c.get("rope_base", 50000.0)), norm_eps=c.get("norm_eps", 1e-6),
        max_seq_len=c["block_size"], tie_embeddings=bool(c.get("tie_embeddings", True)),
        qk_bias=bool(c.get("qk_bias", True)), inject=True, norm_each_step=False, post_norm=True,
        interleaved_rope=True, embed_scale=math.sqrt(dim), norm_before_coda=True,
        init_std=(c.get("init_values") or {}).get("std", math.sqrt(2 / (5 * dim))))


def parcae(c):
    dim, heads = c["n_embd"], c["num_attention_heads"]
    # layouts the released checkpoints do not use, and this code does not run
    if c.get("recurrent_embedding_dimension", dim) != dim:
        width = c["recurrent_embedding_dimension"]
        raise ValueError(f"recurrent_embedding_dimension {width} differs from n_embd {dim}: this "
                         "implementation runs a core as wide as the prelude only")
    core_heads = c.get("recurrent_num_attention_heads")
    if core_heads not in (None, heads) or c.get("num_key_value_heads", heads) != heads:
        raise ValueError("config.json asks for grouped-query attention or other heads in the core: "
                         "this implementation runs Parcae with num_attention_heads heads "
                         "everywhere, as released")
    P, R, C = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"], c["n_layers_in_coda"]
    T, multiple = c["mean_recurrence"], c.get("padding_multiple", 64)
    # value embeddings: a table for every other block, always the last; a gate by the block's layer
    # id, whose coda ids are offset by R * mean_recurrence and whose parity is set by the training
    # depth n_layer = R * mean_backprop_depth (the two rules can disagree)
    n_blocks, n_layer = P + R + C, R * c["mean_backprop_depth"]
    layer_ids = [*range(P + R), *(P + R * T + i for i in range(C))]
    return dict(
        kind="parcae", dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=dim // heads,
        hidden_dim=c["intermediate_size"],
        core_hidden_dim=c.get("recurrent_intermediation_embedding_dimension") or 0,
        vocab_size=c.get("padded_vocab_size") or -(-c["vocab_size"] // multiple) * multiple,
        n_prelude=P, n_core=R, n_coda=C, num_steps=T,
        rope_theta=float((c.get("rope_settings") or {}).get("rope_base", 50000)),
        norm_eps=c.get("norm_eps", 1e-5),
        max_seq_len=c["block_size"], tie_embeddings=bool(c.get("tie_embeddings", True)),
        inject=True, norm_each_step=False, post_norm=False, interleaved_rope=True, embed_scale=1.0,
        init_std=math.sqrt(2 / (5 * dim)), injection="diagonal", sandwich=False,
        qk_norm=bool(c.get("qk_norm", True)), mlp="relu2",
        prelude_norm=bool(c.get("prelude_norm", True)),
        coda_in=True, ve_tables=tuple(k for k in range(n_blocks) if k % 2 == (n_blocks - 1) % 2),
        ve_gates=tuple(k for k in range(n_blocks) if layer_ids[k] % 2 == (n_layer - 1) % 2))


def raven_layout(c, keys=None):
    """Which family of model_type huginn_raven: "huginn" (huginn-0125: sandwich blocks, qk bias, a
    stored RoPE table), or a retrofit's blocks, "llama" (pre-norm) or "olmo2" (post-norm, q and k
    norms). With the checkpoint's tensor names (load), they decide; a config alone (random weights):
    its wfd_layout where it has one (this project's key), else a retrofit's if it has rope_theta
    (huginn-0125's config has none)."""
    if keys is None:
        return c.get("wfd_layout") or ("llama" if "rope_theta" in c else "huginn")
    if any(k == "freqs_cis" or k.endswith((".norm_3.weight", ".attn.qk_bias")) for k in keys):
        return "huginn"
    return "olmo2" if any(k.endswith(".attn.q_norm.weight") for k in keys) else "llama"


def retrofit(c, olmo2):
    """A Raven retrofit: Huginn's prelude, adapter, core and coda with a Llama's pre-norm blocks (or
    OLMo-2's post-norm blocks with q and k norms), GQA, rotate-half RoPE from rope_theta with
    Llama-3 scaling where given, no norm between the recurrence and the coda, an untied head."""
    dim, heads = c["n_embd"], c["n_heads"]
    if c.get("qk_bias"):
        raise ValueError("config.json asks for qk_bias, which the retrofits' blocks do not have")
    scaling, init = c.get("rope_scaling"), c.get("init_values") or {}
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return dict(
        kind="retrofit", dim=dim, n_heads=heads, head_dim=c.get("head_dim") or dim // heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, hidden_dim=c["intermediate_size"],
        vocab_size=c.get("padded_vocab_size") or c["vocab_size"],
        n_prelude=c["n_layers_in_prelude"],
        n_core=c["n_layers_in_recurrent_block"], n_coda=c["n_layers_in_coda"],
        num_steps=c.get("mean_recurrence", 32), rope_theta=float(c["rope_theta"]),
        rope_scaling=tuple(float(scaling[k]) for k in keys) if scaling else None,
        norm_eps=c.get("norm_eps", 1e-6),
        max_seq_len=c.get("max_position_embeddings") or c["block_size"],
        tie_embeddings=bool(c.get("tie_embeddings", True)), inject=True, norm_each_step=False,
        post_norm=False, interleaved_rope=False, embed_scale=float(init.get("embed_scale", 1.0)),
        init_std=init.get("std", math.sqrt(2 / (5 * dim))), sandwich=olmo2, in_norm=not olmo2,
        qk_proj_norm=olmo2, config_stop_ids=False)


def loopformer(c):
    """LoopFormer: its hub config's missing sizes from the official defaults; T = max_model_loops
    (checkpoints.Checkpoint fills it in from the repo id where the config leaves it out)."""
    c = {**LOOPFORMER_DEFAULTS, **c}
    dim, heads = c["n_embd"], c["n_head"]
    if dim % heads:
        raise ValueError(f"n_embd {dim} is not a multiple of n_head {heads}")
    return dict(
        kind="loopformer", dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=dim // heads,
        hidden_dim=c["intermediate_dim"], vocab_size=c["vocab_size"], n_prelude=0,
        n_core=c["n_layer"],
        n_coda=0, num_steps=c["max_model_loops"], rope_theta=10000.0, norm_eps=None,  # no RoPE read
        max_seq_len=c["block_size"], tie_embeddings=True, inject=False, norm_each_step=False,
        post_norm=False, interleaved_rope=False, embed_scale=1.0, sandwich=False,
        norm_weights=False,
        rope=False, mlp="gelu", pos_embed=True, clock=True, config_stop_ids=False)


def iterations_in_name(*names):
    """LoopFormer's iteration count, which its hub config leaves out: the `-<n>iterations` of the
    repo id (armenjeddi/LoopFormer-2block-12iterations: 12), found in any of `names` (the id, or a
    hub cache folder's path, which holds it); None where none says."""
    found = re.search(r"-(\d+)iterations(?=$|[-/\s])", " ".join(map(str, names)))
    return found and int(found.group(1))
