"""ais_lightning: Lightning components for RL of LLMs with low-precision rollouts."""

__version__ = "0.1.0"
