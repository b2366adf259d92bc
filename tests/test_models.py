"""Tests of the models and their checkpoints: parity with the official implementations (golden
checkpoints in tests/testdata/, computed by the official code, see tests/testdata/README.md), and
loading: shards, errors that name the problem, hub downloads, save and load again."""
import dataclasses
import fnmatch
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
import models
from formats import checkpoints
from layers import transformer
from layers.transformer import causal_attention
from test_engine import (GENERATION, GOLDEN, HERE, TOL, cached_greedy, close, golden, loaded,
                         recurrence_states)


def test_model_args_table_says_which_family_sets_which_flag():
    """ModelArgs' docstring table against formats/configs.py: on each family's config, the flags of
    the last group (from `injection` on) that differ from their defaults are those its row names;
    Ouro and Huginn set none of them."""
    fields = dataclasses.fields(models.ModelArgs)
    last = fields[[f.name for f in fields].index("injection"):]
    rows, family = {"Ouro": "", "Huginn": ""}, None
    for line in models.ModelArgs.__doc__.split("\n\n")[1].rstrip().splitlines():
        family = re.split(r"\s{2,}", line.strip())[0] if line[8] != " " else family
        rows[family] = rows.get(family, "") + line
    config = lambda name: json.load(open(os.path.join(HERE, "tests", "testdata", name,
                                                      "config.json")))
    raven = config("raven_A")  # a Llama retrofit with Llama-3's RoPE scaling
    olmo2 = {**{k: v for k, v in raven.items() if k != "rope_scaling"}, "wfd_layout": "olmo2"}
    configs = {"Ouro": config("ouro_A"), "Huginn": config("huginn_A"),
               "Parcae": config("parcae_A"), "LoopFormer": config("loopformer_A"),
               "Llama retrofit": raven, "OLMo-2 retrofit": olmo2}
    assert rows.keys() == configs.keys()
    for family, text in rows.items():
        a = models.ModelArgs.from_config(configs[family])
        named = {f.name for f in last if re.search(rf"\b{f.name}\b", text)}
        assert {f.name for f in last if getattr(a, f.name) != f.default} == named, family


def test_huginn_forward_matches_golden(huginn):
    meta, g = golden("huginn_A")
    ids, tol = meta["prompt_ids"], dict(atol=2e-4)
    assert close(huginn.embed(torch.tensor(ids)) * huginn.args.dim ** 0.5, g["embed_scaled"], **tol)
    e, adapters, states = recurrence_states(huginn, ids, 8)
    assert close(e, g["prelude_out"], **tol)
    assert close(adapters, g["adapter_out_per_step_steps8"], **tol)
    assert close(states, g["core_state_per_step_steps8"], **tol)
    for k in (1, 2, 4, 8):
        assert close(transformer.rms_norm(states[k - 1], huginn.norm, 1e-6),
                     g[f"latent_zero_init_steps{k}"], **tol)
    for k in (0, 1, 2, 4, 8):
        assert close(huginn.logits(ids, num_steps=k), g[f"logits_zero_init_steps{k}"], **tol), k
    assert close(huginn.logits(torch.tensor([ids])), g["logits_zero_init_default_steps"], **tol)
    pos = torch.arange(len(ids))
    coda = huginn._layers(huginn.coda, transformer.rms_norm(states[-1], huginn.norm, 1e-6),
                          models.Call(pos, None))
    assert close(coda, g["coda_out_steps8"], **tol)
    assert close(transformer.rms_norm(coda, huginn.norm, 1e-6), g["final_hidden_steps8"], **tol)


def test_parcae_forward_matches_golden(parcae):
    meta, g = golden("parcae_A")
    ids, tol, eps = meta["prompt_ids"], dict(atol=1e-4), parcae.args.norm_eps
    pos, x = torch.arange(len(ids)), parcae.embed(torch.tensor(ids))
    assert close(x, g["embed"], **tol)
    raw = parcae._layers(parcae.prelude, x, models.Call(pos, None),
                         parcae.value_embeddings(torch.tensor(ids)))
    assert close(raw, g["prelude_raw"], **tol)
    assert close(transformer.rms_norm(raw, parcae.prelude_norm, eps), g["prelude_out"], **tol)
    e, inputs, states = recurrence_states(parcae, ids, 4)
    # [0] = the injection term P made: s0 = 0
    assert close(inputs, g["adapter_out_per_step"], **tol)
    assert close(states, g["state_per_step"], **tol)
    for k in range(1, 5):
        assert close(parcae.C(states[k - 1], e, pos), g["logits_per_step"][k - 1], **tol), k
    assert close(parcae.logits(ids), g["logits"], **tol)  # the default depth is mean_recurrence, 4
    # the official default drew 2
    assert close(parcae.logits(ids, num_steps=2), g["logits_default_forward"], **tol)
    c_out = parcae.coda_in(states[-1])
    coda = parcae._layers(parcae.coda, c_out, models.Call(pos, None),
                          e[:, parcae.args.dim:])
    assert close(c_out, g["C_out"], **tol) and close(coda, g["coda_out"], **tol)
    assert close(transformer.rms_norm(coda, parcae.norm, eps), g["final_hidden"], **tol)
    # value embeddings are mixed in exactly where the official code mixes them
    names = ([f"prelude.{i}" for i in range(len(parcae.prelude))]
             + [f"core_block.{j}" for j in range(len(parcae.core))]
             + [f"coda.{i}" for i in range(len(parcae.coda))])
    blocks = list(parcae.prelude) + list(parcae.core) + list(parcae.coda)
    assert ({n for n, b in zip(names, blocks) if b.ve_gate is not None}
            == {n for n, v in meta["value_embedding_map"].items() if v["ve_applied"]})


RANDOM_STATE = {  # golden: (the explicit s0, [(depth, logits)], states per step, logits per step)
    "huginn_A": ("random_init_state",
                 [(4, "logits_random_init_steps4"), (8, "logits_random_init_steps8")],
                 "core_state_per_step_random_init_steps8", None),
    "parcae_A": ("init_state_random", [(4, "logits_random_init")], "state_per_step_random_init",
                 "logits_per_step_random_init"),
}


@pytest.mark.parametrize("name", RANDOM_STATE)
def test_explicit_random_state_matches_golden(name, request):
    model, (meta, g) = loaded(request, name), golden(name)
    s0, logits, states, step_logits = RANDOM_STATE[name]
    ids, tol = meta["prompt_ids"], dict(atol=TOL[name])
    for k, key in logits:
        assert close(model.logits(ids, num_steps=k, state=g[s0]), g[key], **tol), k
    e, _, ours = recurrence_states(model, ids, len(g[states]), g[s0])
    assert close(ours, g[states], **tol)
    if step_logits:
        pos = torch.arange(len(ids))
        assert close(torch.stack([model.C(s, e, pos) for s in ours]), g[step_logits], **tol)


@pytest.mark.parametrize("name", GENERATION)
def test_generation_matches_golden(name, request):
    """Greedy decoding through the per-depth KV cache, and by full recomputation, as the
    official code."""
    model, (meta, g) = loaded(request, name), golden(name)
    T, tokens, cached, nocache, atol = GENERATION[name]
    ids, want = meta["prompt_ids"], g[tokens].tolist()
    got, logits = cached_greedy(model, ids, 24, T)
    assert got == want
    assert close(logits, g[cached], atol=atol)
    full = torch.stack([model.logits(ids + want[:i], num_steps=T)[-1] for i in range(24)])
    assert full.argmax(-1).tolist() == want
    assert close(full, g[nocache], atol=atol)
    assert engine.generate(model, ids, 24, method="ar", num_steps=T).tokens == want


@pytest.mark.parametrize("name,s0",
                         [("huginn_A", "random_init_state"), ("parcae_A", "init_state_random")])
def test_random_initial_state_is_seeded_by_position(name, s0):
    m = models.load(GOLDEN[name], state_init="random", seed=3)
    a, b = m.initial_state(torch.tensor([5, 6, 7])), m.initial_state(torch.tensor([7]))
    assert torch.equal(a[2], b[0]) and not torch.equal(a[0], a[1])
    # like-init: cut at 3 sigma, times the embedding scale
    bound = 3 * m.args.init_std * m.args.embed_scale
    assert a.abs().max() <= bound + 1e-6
    # the official draw: same sigma and scale
    assert 0.9 * bound < golden(name)[1][s0].abs().max() <= bound + 1e-6
    other = models.load(GOLDEN[name], state_init="random", seed=4).initial_state(torch.tensor([7]))
    assert not torch.equal(other, b)
    # the tied head: the stored duplicate equals wte, and the model uses one matrix for both
    assert m.lm_head.weight is m.embed.weight


def test_ouro_forward_matches_golden(ouro):
    meta, g = golden("ouro_A")
    ids, tol = meta["prompt_ids"], dict(atol=1e-4)
    pos = torch.arange(len(ids))
    h, _ = ouro.P(torch.tensor(ids), pos)
    layer0 = ouro.core[0](h, *ouro.rope(pos), causal_attention)
    assert close(layer0, g["layer0_step1_out"], **tol)
    for t in range(4):
        h = ouro.R(h, None, pos, t)
        assert close(h, g["step_hidden"][t], **tol), t
        assert close(ouro.C(h, None, pos), g["step_logits"][t], **tol), t
    assert close(ouro.logits(ids), g["default_logits"], **tol)
    assert g["gen_nocache_tokens"].tolist() == g["gen_cached_tokens"].tolist()


# The goldens must catch the classic mistakes: each variant below is wrong, and must fail.

COMMON = ["rope layout", "final norm", "untied head"]
PARCAE = ["qk norm", "value embeddings", "relu2 scale", "no decay", "prelude norm"]


@pytest.mark.parametrize("name,mutation",
                         [("ouro_A", m) for m in COMMON + ["norm placement", "norm eps"]] +
                         [("huginn_A", m) for m in COMMON
                          + ["norm placement", "adapter", "qk_bias", "no embed scale"]]
                         + [("parcae_A", m) for m in COMMON + ["norm eps"] + PARCAE])
def test_goldens_catch_wrong_variants(name, mutation, monkeypatch):
    model = models.load(GOLDEN[name], state_init="zero")
    if mutation == "rope layout":
        rope = transformer.apply_rope
        monkeypatch.setattr(transformer, "apply_rope",
                            lambda x, c, s, inter: rope(x, c, s, not inter))
    elif mutation == "norm eps":
        # not Huginn: it moves Huginn's logits less than their 2e-4 tolerance
        model.args.norm_eps = {"ouro_A": 1e-5, "parcae_A": 1e-6}[name]
    elif mutation == "norm placement":  # post-residual norms where the other family puts them
        model.args.post_norm = not model.args.post_norm
    elif mutation == "final norm":  # Ouro's model.norm / Huginn's and Parcae's ln_f skipped
        norm = models.rms_norm
        monkeypatch.setattr(models, "rms_norm",
                            lambda x, w, eps: x if w is model.norm else norm(x, w, eps))
    elif mutation == "prelude norm":
        model.prelude_norm.data.fill_(1.0)
    elif mutation == "qk norm":
        model.args.qk_norm = False
    elif mutation == "value embeddings":
        for blk in list(model.prelude) + list(model.core) + list(model.coda):
            blk.ve_gate = None
    elif mutation == "relu2 scale":  # relu(x)^2 without the factor 0.5
        relu = transformer.F.relu
        monkeypatch.setattr(transformer.F, "relu", lambda x: relu(x) * 2 ** 0.5)
    elif mutation == "no decay":  # s + softplus(dt) * (e B^T)
        monkeypatch.setattr(transformer.DiagonalInjection, "decay",
                            lambda self: torch.ones_like(self.A_log))
    elif mutation == "adapter":  # concat(e, s) instead of concat(s, e)
        w = model.adapter.weight
        w.data = torch.cat([w[:, w.shape[1] // 2:], w[:, :w.shape[1] // 2]], 1)
    elif mutation == "qk_bias":
        for blk in list(model.prelude) + list(model.core) + list(model.coda):
            blk.qk_bias.data.zero_()
    elif mutation == "untied head":
        model.lm_head.weight = torch.nn.Parameter(model.embed.weight.roll(1, 0)
                                                  if name != "ouro_A"
                                                  else model.embed.weight.clone())
    elif mutation == "no embed scale":
        model.args.embed_scale = 1.0
    meta, g = golden(name)
    if name == "huginn_A":
        got = model.logits(meta["prompt_ids"], num_steps=8, state=g["random_init_state"])
        assert not close(got, g["logits_random_init_steps8"], atol=2e-4)
    else:
        assert not close(model.logits(meta["prompt_ids"]),
                         g["logits" if name == "parcae_A" else "default_logits"],
                         atol=1e-4)


# -- loading ---------------------------------------------------------------------------------------

def test_sharded_bf16_checkpoint_loads(tmp_path, ouro):
    meta, g = golden("ouro_A")
    tensors = load_file(os.path.join(GOLDEN["ouro_A"], "model.safetensors"))
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        save_file({k: tensors[k].to(torch.bfloat16) for k in ks}, tmp_path / fname)
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: fname for fname, ks in shards.items() for k in ks}}, f)
    with open(os.path.join(GOLDEN["ouro_A"], "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    m = models.load(str(tmp_path))
    assert m.dtype == torch.bfloat16
    # bf16 rounding only
    assert (m.logits(meta["prompt_ids"]) - g["default_logits"]).abs().max() < 0.5
    m32 = models.load(str(tmp_path), dtype=torch.float32)
    assert m32.dtype == torch.float32


def read_weights(name):
    """A golden checkpoint's tensors, and the file they came from (Parcae's: a torch pickle)."""
    pickled = name == "parcae_A"
    file = "pytorch_model.bin" if pickled else "model.safetensors"
    path = os.path.join(GOLDEN[name], file)
    return (torch.load(path, weights_only=True) if pickled else load_file(path)), file


def broken_copy(tmp_path, name, edit_config=None, edit_tensors=None, file=None):
    """A golden checkpoint rewritten, its config and tensors edited first
    (into `file`, default theirs)."""
    with open(os.path.join(GOLDEN[name], "config.json")) as f:
        config = json.load(f)
    tensors, theirs = read_weights(name)
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    file = file or theirs
    if file.endswith(".safetensors"):
        save_file(tensors, tmp_path / file)
    else:
        torch.save(tensors, tmp_path / file)
    return str(tmp_path)


def test_load_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown model_type 'llama'.*'ouro'.*'huginn_raven'"):
        models.load(broken_copy(tmp_path / "a", "ouro_A",
                                edit_config=lambda c: c.update(model_type="llama")))
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        models.load(broken_copy(tmp_path / "b", "ouro_A",
                                edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        models.load(broken_copy(tmp_path / "c", "ouro_A", edit_tensors=lambda t: t.update(
            {"model.layers.2.mlp.up_proj.weight": torch.zeros(1)})))
    with pytest.raises(ValueError, match=r"'transformer.adapter.weight' has shape \(64, 64\), "
                       r"expected \(64, 128\)"):
        models.load(broken_copy(tmp_path / "d", "huginn_A", edit_tensors=lambda t: t.update(
            {"transformer.adapter.weight": torch.zeros(64, 64)})))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape"):
        models.load(broken_copy(tmp_path / "e", "ouro_A",
                                edit_config=lambda c: c.update(num_key_value_heads=4)))
    with pytest.raises(ValueError, match="does not support: rope_scaling="):
        models.load(broken_copy(tmp_path / "f", "ouro_A",
                                edit_config=lambda c: c.update(rope_scaling={"type": "yarn"})))
    with pytest.raises(ValueError, match="lacks 'n_layers_in_coda'"):
        models.load(broken_copy(tmp_path / "g", "huginn_A",
                                edit_config=lambda c: c.pop("n_layers_in_coda")))
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        models.load(str(tmp_path / "no" / "such" / "folder"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load(str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="the hub cannot be reached.*local folder"):
        models.load("ByteDance/Ouro-2.6B")


class Payload:
    """Unpickled without weights_only, it runs print: any code could run in its place."""

    def __reduce__(self):
        return print, ("the payload ran",)


def test_parcae_load_errors_name_the_problem(tmp_path, capsys):
    def nan(t):
        t["transformer.adapter.B"][1, 2] = float("nan")
    cases = [
        (dict(edit_config=lambda c: c.update(_class_name="GPTConfig")),
         "unknown _class_name 'GPTConfig' in config.json; supported: .*'ParcaeConfig'"),
        (dict(edit_tensors=lambda t: t.pop("value_embeds.3.weight")),
         "lacks tensor 'value_embeds.3.weight'"),
        (dict(edit_tensors=lambda t: t.pop("transformer.core_block.0.attn.ve_gate.weight")),
         "lacks tensor 'transformer.core_block.0.attn.ve_gate.weight'"),
        (dict(edit_tensors=lambda t: t.update(
            {"transformer.core_block.1.attn.ve_gate.weight": torch.zeros(4, 32)})),
         "unexpected tensor 'transformer.core_block.1.attn.ve_gate.weight'"),
        (dict(edit_tensors=lambda t: t.update({"transformer.C.weight": torch.zeros(64, 32)})),
         r"'transformer.C.weight' has shape \(64, 32\), expected \(64, 64\)"),
        (dict(edit_tensors=nan),
         r"tensor 'transformer.adapter.B' in \S+pytorch_model\.bin holds NaN or inf"),
        (dict(edit_config=lambda c: c.update(init_strategy="takase")),
         "does not support: init_strategy='takase'"),
        (dict(edit_config=lambda c: c.update(recurrent_embedding_dimension=32)),
         "recurrent_embedding_dimension 32"),
        (dict(edit_config=lambda c: c.update(num_key_value_heads=2)), "grouped-query attention"),
        (dict(edit_tensors=lambda t: t.update(extra=Payload())),
         r"pytorch_model\.bin holds more than tensors \(print\), "
         r"which weights_only loading refuses"),
        (dict(edit_tensors=lambda t: t.update(step=3)),
         r"pytorch_model\.bin does not hold a state dict"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            models.load(broken_copy(tmp_path / str(i), "parcae_A", **edit))
    assert "the payload ran" not in capsys.readouterr().out
    with pytest.raises(ValueError,
                       match=r"pytorch_model\.bin is not a readable torch checkpoint \(truncated"):
        models.load(damaged_copy(tmp_path / "cut", "parcae_A", "pytorch_model.bin",
                                 lambda d: d[:len(d) // 2]))


def test_parcae_weight_files(tmp_path, parcae):
    """model.pt (the name parcae_lm's own save gives it) and the pre-zip torch format, which cannot
    be mapped into memory, load as pytorch_model.bin does."""
    ids = [0, 5, 9, 3]
    for i, (file, legacy) in enumerate([("model.pt", False), ("pytorch_model.bin", True)]):
        folder = broken_copy(tmp_path / str(i), "parcae_A", file=file)
        if legacy:
            torch.save(read_weights("parcae_A")[0], os.path.join(folder, file),
                       _use_new_zipfile_serialization=False)
        assert torch.equal(models.load(folder, state_init="zero").logits(ids),
                           parcae.logits(ids)), file


def test_hub_downloads_fetch_the_weights_each_family_has(tmp_path, monkeypatch):
    """From the hub: config, safetensors and tokenizer first; a torch pickle only for a repo without
    safetensors (a repo may hold both); a tokenizer repo's tokenizer.json alone."""
    import huggingface_hub
    calls = []

    # a hub that holds the golden checkpoints, goldens aside
    def snapshot_download(repo, allow_patterns):
        calls.append((repo, allow_patterns))
        src, folder = GOLDEN[repo.split("/")[1]], tmp_path / repo.replace("/", "--")
        folder.mkdir(exist_ok=True)
        for name in os.listdir(src):
            if not name.startswith("golden") and any(fnmatch.fnmatch(name, p)
                                                     for p in allow_patterns):
                shutil.copy(os.path.join(src, name), folder)
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert models.load("hub/parcae_A").kind == "parcae" and models.load("hub/ouro_A").kind == "ouro"
    assert calls == [("hub/parcae_A", checkpoints.HUB_FILES),
                     ("hub/parcae_A", list(checkpoints.PICKLES)),
                     ("hub/ouro_A", checkpoints.HUB_FILES)]
    shutil.copy(os.path.join(HERE, "demo", "tokenizer.json"), tmp_path / "hub--parcae_A")
    assert checkpoints.load_tokenizer("hub/parcae_A").get_vocab_size() == 2048
    assert calls[-1] == ("hub/parcae_A", ["tokenizer.json"])


def damaged_copy(tmp_path, name, file, damage):
    """A copy of a golden checkpoint (and the demo's tokenizer) with `file` rewritten by
    damage(bytes)."""
    shutil.copytree(GOLDEN[name], tmp_path)
    shutil.copy(os.path.join(HERE, "demo", "tokenizer.json"), tmp_path)
    path = tmp_path / file
    path.write_bytes(damage(path.read_bytes()))
    return str(tmp_path)


def test_damaged_files_are_named(tmp_path):
    def nan_weights(data):  # 0xFF bytes in the tensor data: NaN in fp32
        header_end = 8 + int.from_bytes(data[:8], "little")
        return data[:header_end + 64] + b"\xff" * 4096 + data[header_end + 64 + 4096:]
    cases = [("config.json", lambda d: d[:20], r"config\.json is not valid JSON"),
             ("config.json", lambda d: b"[1, 2]", r"config\.json holds a JSON list, not an object"),
             ("model.safetensors", lambda d: d[:len(d) // 2],
              r"model\.safetensors is not a readable safetensors file"),
             ("model.safetensors", lambda d: d[:8] + b"\xff" * 64 + d[72:],
              r"model\.safetensors is not a readable"),
             ("model.safetensors", nan_weights,
              r"tensor '[\w.]+' in \S+model\.safetensors holds NaN or inf"),
             ("tokenizer.json", lambda d: d[:100],
              r"tokenizer\.json is not a tokenizer\.json that tokenizers can read")]
    for i, (file, damage, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            models.load(damaged_copy(tmp_path / str(i), "ouro_A", file, damage))


def test_missing_folders_and_devices_are_told_apart(tmp_path, monkeypatch):
    for path in ("./no_such_model", "../no/such", str(tmp_path / "nothing"), "~/no_such_model",
                 "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no such model folder: " + re.escape(path)):
            models.load(path)
    with pytest.raises(FileNotFoundError, match="is a file, not a model folder"):
        models.load(os.path.join(GOLDEN["ouro_A"], "config.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda': this torch .* has no CUDA"):
        models.load(GOLDEN["ouro_A"], device="cuda")


def test_save_roundtrip(tmp_path, huginn, ouro, parcae):
    for m in (huginn, ouro, parcae):
        models.save(m, tmp_path / m.kind)
        again = models.load(str(tmp_path / m.kind), state_init="zero")
        ids = [3, 1, 4, 1, 5]
        assert torch.equal(again.logits(ids), m.logits(ids))
    # Parcae's file is the official one: the same tensors under the same names, the tied head shared
    saved = torch.load(tmp_path / "parcae" / "pytorch_model.bin", weights_only=True)
    official, _ = read_weights("parcae_A")
    assert saved.keys() == official.keys() and all(torch.equal(saved[k], official[k])
                                                   for k in official)
    assert saved["lm_head.weight"].data_ptr() == saved["transformer.wte.weight"].data_ptr()
