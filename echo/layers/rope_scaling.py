"""Llama-3's rotary frequency scaling as read from config.json: a plain record, without torch, so
reading a model's shape (models/arch.py, the config) stays light in the frontend process."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
