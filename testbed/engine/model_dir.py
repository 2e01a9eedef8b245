"""The tiny model directory the testbed writes for vLLM (no hub, no download).

``config.json`` describes a small Llama (head_dim 64, as vLLM's CPU attention wants); the
``vllm`` engine also writes seeded random weights (``model.safetensors``) so that greedy outputs
depend on the input and a wrong KV round trip would change them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModel:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 8192

    def config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def write_model_dir(directory: Path, model: TinyModel) -> Path:
    """Writes ``config.json`` (once; an existing identical one is kept). Returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    text = json.dumps(model.config(), indent=1, sort_keys=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return directory
