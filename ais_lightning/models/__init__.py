"""The tiny built-in Qwen3 and its local character tokenizer (no hub access)."""

from ais_lightning.models.tiny import build_tiny_qwen3, save_tiny_model, tiny_qwen3_config
from ais_lightning.models.tiny_diffusion import (
    MASK_TOKEN_ID,
    TinyDiffusionConfig,
    TinyDiffusionLM,
    build_diffusion_tokenizer,
    build_tiny_diffusion,
    tiny_diffusion_config,
)
from ais_lightning.models.tokenizer import build_char_tokenizer

__all__ = [
    "MASK_TOKEN_ID",
    "TinyDiffusionConfig",
    "TinyDiffusionLM",
    "build_char_tokenizer",
    "build_diffusion_tokenizer",
    "build_tiny_diffusion",
    "build_tiny_qwen3",
    "save_tiny_model",
    "tiny_diffusion_config",
    "tiny_qwen3_config",
]
