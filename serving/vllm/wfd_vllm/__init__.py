"""The project's looped LMs registered with vLLM (entry point group vllm.general_plugins).

The plugin is this repository's: it reads configs and checkpoint names through the project's
formats/ and layers/, so it is installed editable (`pip install -e serving/vllm`) and finds them
two folders up."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

# config.json's architectures entry -> model_type, for each family the plugin serves
ARCHITECTURES = {"OuroForCausalLM": "ouro"}


def register():
    """Called by vLLM in every process it starts: the architectures, and their config classes
    (transformers knows none of these model types)."""
    from transformers import AutoConfig, PretrainedConfig
    from vllm import ModelRegistry

    for arch, model_type in ARCHITECTURES.items():
        config = type(f"{arch}Config", (PretrainedConfig,), {"model_type": model_type})
        try:
            AutoConfig.register(model_type, config)
        except ValueError:  # registered already in this process
            pass
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "wfd_vllm.model:LoopedForCausalLM")
