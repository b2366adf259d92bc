"""The project's looped LMs registered with vLLM (entry point group vllm.general_plugins).

The plugin is this repository's: it reads configs and checkpoint names through the project's
formats/ and layers/, so it is installed editable (`pip install -e serving/vllm`) and finds them
two folders up."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

from transformers import PretrainedConfig  # noqa: E402


class OuroConfig(PretrainedConfig):
    """config.json's keys as attributes (formats/configs.py reads them); at module level, so that
    vLLM's worker processes can unpickle it."""
    model_type = "ouro"


SCALING = "wfd_rope_scaling"


class HuginnConfig(PretrainedConfig):
    """huginn-0125's and the Raven retrofits' config.json, its sizes also under the names vLLM
    reads."""
    model_type = "huginn_raven"
    VLLM_NAMES = {"hidden_size": "n_embd", "num_attention_heads": "n_heads",
                  "num_hidden_layers": "n_layers", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        # a retrofit's Llama-3 RoPE scaling, kept as config.json has it under a name of its own
        # (wfd_vllm.model.model_args reads it back): transformers would rewrite rope_scaling
        if kwargs.get("rope_scaling"):
            kwargs[SCALING] = kwargs.pop("rope_scaling")
        super().__init__(**kwargs)
        for name, theirs in self.VLLM_NAMES.items():
            if not hasattr(self, name) and hasattr(self, theirs):
                setattr(self, name, getattr(self, theirs))


class LoopFormerConfig(HuginnConfig):
    """LoopFormer's config.json, the sizes its hub file leaves out from the official defaults (the
    iteration count too where the repo id does not give it: wfd_vllm.model.model_args)."""
    model_type = "loopformer"
    VLLM_NAMES = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                  "num_hidden_layers": "n_layer", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        from formats.configs import LOOPFORMER_DEFAULTS
        sizes = {k: v for k, v in LOOPFORMER_DEFAULTS.items() if k != "max_model_loops"}
        super().__init__(**{**sizes, **kwargs})


class ParcaeConfig(HuginnConfig):
    """Parcae's config.json, a dump of its config class with neither model_type nor architectures
    (named by _class_name, as formats/configs.py reads it): read by parse_config, given its
    architecture here; wfd_vllm.model.model_args reads the dump as models.load does."""
    model_type = "parcae"
    ARCHITECTURE = "ParcaeForCausalLM"
    VLLM_NAMES = {"hidden_size": "n_embd", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not self.architectures:
            self.architectures = [self.ARCHITECTURE]
        if hasattr(self, "n_layers_in_prelude"):
            self.num_hidden_layers = (self.n_layers_in_prelude + self.n_layers_in_recurrent_block
                                      + self.n_layers_in_coda)
        # the head's width, which vLLM sizes the logits by (formats.configs.parcae's rule)
        padded = getattr(self, "padded_vocab_size", None)
        multiple = getattr(self, "padding_multiple", 64)
        if hasattr(self, "vocab_size"):
            self.vocab_size = padded or -(-self.vocab_size // multiple) * multiple


# config.json's architectures entry -> its config class, for each family the plugin serves
ARCHITECTURES = {"OuroForCausalLM": OuroConfig, "RavenForCausalLM": HuginnConfig,
                 "LoopFormerGPTForCausalLM": LoopFormerConfig,
                 ParcaeConfig.ARCHITECTURE: ParcaeConfig}


def parse_config(parse):
    """vLLM's "hf" config parser's parse, reading Parcae's dump too: transformers' AutoConfig
    (vLLM's reading of config.json) refuses a config.json without model_type, and vLLM reads
    one only from model_type or a few architectures it lists, which Parcae's lacks."""
    def parcae_or_hf(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
        config, _ = PretrainedConfig.get_config_dict(model, revision=revision)
        if "model_type" in config or config.get("_class_name") != "ParcaeConfig":
            return parse(self, model, trust_remote_code, revision, code_revision, **kwargs)
        return config, ParcaeConfig.from_dict(config, name_or_path=str(model))
    parcae_or_hf.reads_parcae = True
    return parcae_or_hf


def register():
    """Called by vLLM in every process it starts: the architectures, and their config classes
    (transformers knows none of these model types); the "hf" config parser taught Parcae's
    dump (the user then names no config format, and the checkpoint stays as published)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import (HFConfigParser, get_config_parser,
                                                register_config_parser)

    if not getattr(get_config_parser("hf").parse, "reads_parcae", False):
        # a subclass of vLLM's, registered in its place (vLLM logs that it overwrites "hf")
        register_config_parser("hf")(type("ParcaeOrHFConfigParser", (HFConfigParser,), {
            "parse": parse_config(HFConfigParser.parse)}))

    for arch, config in ARCHITECTURES.items():
        try:
            AutoConfig.register(config.model_type, config)
        except ValueError:  # registered already in this process
            pass
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "wfd_vllm.model:LoopedForCausalLM")
