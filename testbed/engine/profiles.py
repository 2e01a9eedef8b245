"""KV model shapes: how many bytes of KV a token has, and how TP splits them.

A profile names a model's KV geometry. Without MLA each of ``num_kv_heads`` heads holds a key
and a value vector of ``head_dim`` per layer, and tensor parallelism gives each rank
``num_kv_heads / tp`` heads (its own shard, its own cache objects). With MLA each layer holds
one latent vector of ``head_dim`` per token, replicated on every rank: one copy is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = 2  # fp16 / bf16


@dataclass(frozen=True)
class KVProfile:
    name: str
    num_layers: int
    num_kv_heads: int
    """KV heads (1 for MLA: the latent)."""
    head_dim: int
    """Per-head dimension, or the latent dimension with MLA."""
    mla: bool = False

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"profile {self.name}: layers, heads and head_dim must be positive")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(f"profile {self.name}: an MLA profile has one latent, not heads")

    @property
    def kv_factor(self) -> int:
        """Vectors per head and token: key and value (2), or the latent alone (1)."""
        return 1 if self.mla else 2

    def heads_per_rank(self, tp: int) -> int:
        if self.mla:
            return 1
        if self.num_kv_heads % tp:
            raise ValueError(
                f"profile {self.name} has {self.num_kv_heads} KV heads, which TP={tp} cannot "
                f"split evenly; choose a TP size dividing {self.num_kv_heads}"
            )
        return self.num_kv_heads // tp

    def elements_per_token_layer(self, tp: int = 1) -> int:
        """KV elements one rank holds per token and layer."""
        return self.kv_factor * self.heads_per_rank(tp) * self.head_dim

    def bytes_per_token(self, tp: int = 1) -> int:
        """Bytes of KV one rank holds per token (all layers)."""
        return self.num_layers * self.elements_per_token_layer(tp) * DTYPE_BYTES

    def stored_bytes_per_token(self, tp: int = 1) -> int:
        """Bytes the cache stores per token: every rank's shard, or one latent copy (MLA)."""
        copies = 1 if self.mla else tp
        return self.bytes_per_token(tp) * copies


PROFILES: dict[str, KVProfile] = {
    p.name: p
    for p in (
        # 128 bytes/token: a 20M-token replay's KV fits in a few GB.
        KVProfile("tiny", num_layers=2, num_kv_heads=4, head_dim=4),
        KVProfile("tiny-mla", num_layers=2, num_kv_heads=1, head_dim=32, mla=True),
        # Llama-3-8B: 32 layers, 8 KV heads (GQA) of 128 → 128 KiB/token.
        KVProfile("llama3-8b", num_layers=32, num_kv_heads=8, head_dim=128),
        # DeepSeek-V3-like MLA: 61 layers, 512 latent + 64 rope dims → ~70 KB/token.
        KVProfile("deepseek-mla", num_layers=61, num_kv_heads=1, head_dim=576, mla=True),
    )
}


def get_profile(name: str) -> KVProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown KV profile {name!r}; choose one of {sorted(PROFILES)}") from None
