"""The tiny model directory the testbed writes for vLLM (no hub, no download).

``config.json`` describes a small Llama (head_dim 64, as vLLM's CPU attention wants); the
``vllm`` engine also writes seeded random weights (``model.safetensors``) so that greedy outputs
depend on the input and a wrong KV round trip would change them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


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
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def write_model_dir(directory: Path, model: TinyModel, *, weights_seed: int | None = None) -> Path:
    """Writes ``config.json`` and, with ``weights_seed``, seeded random weights. Returns the
    directory. Existing identical files are kept."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    text = json.dumps(model.config(), indent=1, sort_keys=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
        (directory / "model.safetensors").unlink(missing_ok=True)
    if weights_seed is not None:
        weights = directory / "model.safetensors"
        stamp = directory / "weights-seed"
        if not weights.exists() or not stamp.exists() or stamp.read_text() != str(weights_seed):
            save_file(random_weights(model, weights_seed), str(weights), metadata={"format": "pt"})
            stamp.write_text(str(weights_seed))
    return directory


def random_weights(model: TinyModel, seed: int) -> dict[str, torch.Tensor]:
    """Llama weights under the Hugging Face names vLLM's loader expects, scaled so that
    attention is not uniform and greedy tokens depend on the whole input."""
    generator = torch.Generator().manual_seed(seed)
    h, d, v = model.hidden_size, model.head_dim, model.vocab_size
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(model.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_proj.weight": (model.num_attention_heads * d, h),
            layer + "self_attn.k_proj.weight": (model.num_key_value_heads * d, h),
            layer + "self_attn.v_proj.weight": (model.num_key_value_heads * d, h),
            layer + "self_attn.o_proj.weight": (h, model.num_attention_heads * d),
            layer + "mlp.gate_proj.weight": (model.intermediate_size, h),
            layer + "mlp.up_proj.weight": (model.intermediate_size, h),
            layer + "mlp.down_proj.weight": (h, model.intermediate_size),
        }
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            tensor = torch.randn(shape, generator=generator)
        elif name == "lm_head.weight":
            tensor = torch.randn(shape, generator=generator) * (4.0 / shape[1] ** 0.5)
        else:
            scale = 1.0 / shape[1] ** 0.5
            if ".q_proj." in name or ".k_proj." in name:
                scale *= 2.0  # sharper attention: outputs depend on which tokens are attended
            tensor = torch.randn(shape, generator=generator) * scale
        weights[name] = tensor.contiguous()
    return weights
