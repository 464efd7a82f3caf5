"""Bundled model configs (Hugging Face ``config.json`` files) for examples and benchmarks.

``moe-1t`` is a 1T-parameter MoE in Qwen3-MoE form with the dimensions of the largest
open MoE models (61 layers, 384 experts, hidden 7168, expert ffn 2048, vocab 163840).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from weightsync.layout.model import ModelSpec


def bundled_names() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".json"))


def load_spec(name_or_path: str | Path) -> ModelSpec:
    """A config file or directory path, or the name of a bundled config."""
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_file(path)
    bundled = resources.files(__name__) / f"{name_or_path}.json"
    if bundled.is_file():
        import json

        return ModelSpec.from_hf_config(json.loads(bundled.read_text()))
    raise ValueError(
        f"model config {str(name_or_path)!r} is neither a file nor a bundled config; "
        f"bundled: {', '.join(bundled_names())}"
    )
