"""Prompt text to token ids, as a model expects it: raw, or in the tokenizer's chat template.

Every place that turns a task's prompt into token ids (GRPO rollouts, the SFT warm start and its
greedy evaluation, the measuring tools) goes through :func:`encode_prompts`, so a run trains, evaluates
and warm-starts on one format. With ``chat_template=True`` each prompt becomes one user message rendered
by the tokenizer's own template with the generation prompt appended (what TRL's GRPO does for
conversational data), then tokenized without adding special tokens again (the template writes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["check_chat_template", "encode_prompts"]


def check_chat_template(tokenizer: Any, where: str = "tokenizer") -> None:
    """ValueError when ``tokenizer`` has no chat template to render prompts with."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template=True needs a tokenizer with a chat template; {where} ({type(tokenizer).__name__}) "
            "has none (set tokenizer.chat_template, or keep raw prompts with chat_template=False)"
        )


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt: the raw text, or one user message in the tokenizer's chat template."""
    if not chat_template:
        return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    check_chat_template(tokenizer)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
