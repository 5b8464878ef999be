"""Shared builders of the warm-start tests."""

from ais_lightning.app.warmstart import WarmStartSettings
from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy


def make_policy(seed: int = 0, **overrides) -> Policy:
    return Policy(build_tiny_qwen3(seed=seed, **overrides))


def tiny_settings(tmp_path, **overrides) -> WarmStartSettings:
    """Seconds-sized settings: 4-pair batches, 8 held-out prompts, 4-token greedy answers."""
    base = dict(
        steps=2, batch_size=4, eval_size=8, max_new_tokens=4, warmup_steps=3, eval_every=2,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    base.update(overrides)
    return WarmStartSettings(**base)
