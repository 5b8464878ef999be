"""The tiny built-in models and their local tokenizers (no hub access), and what the library knows of
Hugging Face causal LMs: their output head (:mod:`.head`) and their preparation for training (:mod:`.training`)."""

from ais_lightning.models.tiny import build_tiny_qwen3, save_tiny_model, tiny_qwen3_config
from ais_lightning.models.tiny_diffusion import (
    MASK_TOKEN_ID,
    TinyDiffusionConfig,
    TinyDiffusionLM,
    build_diffusion_tokenizer,
    build_tiny_diffusion,
    tiny_diffusion_config,
)
from ais_lightning.models.tiny_moe import build_tiny_qwen3_moe, tiny_qwen3_moe_config
from ais_lightning.models.tokenizer import build_char_tokenizer
from ais_lightning.models.training import disable_dropout_in, enable_activation_checkpointing

__all__ = [
    "MASK_TOKEN_ID",
    "TinyDiffusionConfig",
    "TinyDiffusionLM",
    "build_char_tokenizer",
    "build_diffusion_tokenizer",
    "build_tiny_diffusion",
    "build_tiny_qwen3",
    "build_tiny_qwen3_moe",
    "disable_dropout_in",
    "enable_activation_checkpointing",
    "save_tiny_model",
    "tiny_diffusion_config",
    "tiny_qwen3_config",
    "tiny_qwen3_moe_config",
]
