"""KV model shapes: how many bytes of KV a token has, and how TP splits them.

A profile names a model's KV geometry. Without MLA each of ``num_kv_heads`` heads holds a key
and a value vector of ``head_dim`` per layer, and tensor parallelism gives each rank
``num_kv_heads / tp`` heads (its own shard, its own cache objects). With MLA each layer holds
one latent vector of ``head_dim`` per token, replicated on every rank: one copy is stored.

A profile may also carry the model's *compute shape* (parameters, query heads), which the time
model (:mod:`testbed.models.time_model`) needs to project prefill time; profiles without it
(the tiny ones) only size KV.
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
    num_params: int | None = None
    """Model parameters: the weights a forward step reads (``None``: no compute shape)."""
    num_active_params: int | None = None
    """Parameters of the transformer blocks one token goes through (MoE: the active experts;
    embeddings and the LM head excluded): 2 FLOPs each per token. ``None``: ``num_params``."""
    num_query_heads: int | None = None
    """Attention query heads (GQA: more than ``num_kv_heads``)."""
    qk_head_dim: int | None = None
    """Per query head, the query/key dimension attention multiplies (``None``: head_dim)."""
    v_head_dim: int | None = None
    """Per query head, the value dimension (``None``: head_dim)."""

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"profile {self.name}: layers, heads and head_dim must be positive")
        shape = (self.num_params, self.num_query_heads)
        if (shape[0] is None) != (shape[1] is None):
            raise ValueError(
                f"profile {self.name}: give num_params and num_query_heads together (or neither)"
            )
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

    @property
    def has_compute_shape(self) -> bool:
        """Whether the profile has what the time model needs (parameters, query heads)."""
        return self.num_params is not None and self.num_query_heads is not None

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
        # Llama-3-8B: 32 layers, 8 KV heads (GQA) of 128 → 128 KiB/token. 8.03B parameters
        # (untied 128256 x 4096 embedding and LM head), 6.98B in the 32 blocks, 32 query heads.
        KVProfile(
            "llama3-8b",
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            num_params=8_030_261_248,
            num_active_params=6_979_584_000,
            num_query_heads=32,
        ),
        # DeepSeek-V3-like MLA: 61 layers, 512 latent + 64 rope dims → ~70 KB/token. 671B
        # parameters, 37B active per token; 128 query heads, q/k 192 (128 + 64 rope), v 128.
        KVProfile(
            "deepseek-mla",
            num_layers=61,
            num_kv_heads=1,
            head_dim=576,
            mla=True,
            num_params=671_000_000_000,
            num_active_params=37_000_000_000,
            num_query_heads=128,
            qk_head_dim=192,
            v_head_dim=128,
        ),
    )
}


def get_profile(name: str) -> KVProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown KV profile {name!r}; choose one of {sorted(PROFILES)}") from None
