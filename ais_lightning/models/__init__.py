"""The tiny built-in Qwen3 and its local character tokenizer (no hub access)."""

from ais_lightning.models.tiny import build_tiny_qwen3, save_tiny_model, tiny_qwen3_config
from ais_lightning.models.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "build_tiny_qwen3", "save_tiny_model", "tiny_qwen3_config"]
