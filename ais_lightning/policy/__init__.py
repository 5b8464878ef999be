"""Policy: a Hugging Face causal LM wrapper (response log-probs, entropy, full weights for sync)."""

from ais_lightning.models.training import disable_dropout_in, enable_activation_checkpointing
from ais_lightning.policy.builders import (
    GGUFPretrained,
    PolicySpec,
    Pretrained,
    SmolLM2,
    TinyQwen3,
    TinyQwen3Moe,
)
from ais_lightning.policy.diffusion import DiffusionPolicy, TinyLLaDA, tiny_diffusion_policy
from ais_lightning.policy.policy import (
    Policy,
    ResponseLogprobs,
    build_sequences,
    chunked_response_logprobs,
    load_named_tensors,
)

POLICIES: dict[str, type[PolicySpec]] = {
    "tiny_qwen3": TinyQwen3,
    "tiny_qwen3_moe": TinyQwen3Moe,
    "local": Pretrained,
    "gguf": GGUFPretrained,
    "smollm2": SmolLM2,
    "tiny_llada": TinyLLaDA,
}
"""The registry of policy options: config name -> :class:`PolicySpec` subclass (``ais-train`` generates the schema
``schema/policy/<name>`` of each; docs/design.md, "Adding a policy")."""

__all__ = [
    "POLICIES",
    "DiffusionPolicy",
    "GGUFPretrained",
    "Policy",
    "PolicySpec",
    "Pretrained",
    "ResponseLogprobs",
    "SmolLM2",
    "TinyLLaDA",
    "TinyQwen3",
    "TinyQwen3Moe",
    "build_sequences",
    "chunked_response_logprobs",
    "disable_dropout_in",
    "enable_activation_checkpointing",
    "load_named_tensors",
    "tiny_diffusion_policy",
]
