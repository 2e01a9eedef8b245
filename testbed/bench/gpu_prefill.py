"""Prefill time of a Llama-3-8B-shaped model with random weights (no download), on a GPU.

The calibration half of ``testbed.bench.gpu_data_path``: the model is the ``llama3-8b`` profile's
compute shape (32 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP 14336, vocabulary
128256), bf16 weights drawn at random on the device, run as one prefill of the whole prompt:
RMSNorm, QKV, causal grouped-query attention (``scaled_dot_product_attention``: FlashAttention
where torch has it), output projection, SwiGLU MLP, and the LM head for the last token only.
Rotary embeddings are left out (elementwise, a fraction of a percent of the FLOPs). With
``num_layers`` below 32 the time is scaled up by ``32 / num_layers`` (layers are identical in
cost); the results say which was run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32


class RandomLlama:
    """Random bf16 weights in the model's shapes, on ``device``."""

    def __init__(self, device: torch.device, num_layers: int = LAYERS, seed: int = 0) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)

        def weight(*shape: int) -> torch.Tensor:
            w = torch.empty(*shape, dtype=torch.bfloat16, device=device)
            return w.normal_(0.0, 0.02, generator=generator)

        self.num_layers = num_layers
        self.embedding = weight(VOCAB, HIDDEN)
        self.lm_head = weight(HIDDEN, VOCAB)
        self.layers = [
            {
                "qkv": weight(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
                "o": weight(HEADS * HEAD_DIM, HIDDEN),
                "gate_up": weight(HIDDEN, 2 * MLP),
                "down": weight(MLP, HIDDEN),
            }
            for _ in range(num_layers)
        ]

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last token after a prefill of ``tokens`` (one sequence)."""
        x = self.embedding[tokens]
        n = len(tokens)
        for w in self.layers:
            h = F.rms_norm(x, (HIDDEN,))
            q, k, v = (h @ w["qkv"]).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
            )
            q = q.view(n, HEADS, HEAD_DIM).transpose(0, 1)
            k = k.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
            v = v.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + attention.transpose(0, 1).reshape(n, HEADS * HEAD_DIM) @ w["o"]
            gate, up = (F.rms_norm(x, (HIDDEN,)) @ w["gate_up"]).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return F.rms_norm(x[-1:], (HIDDEN,)) @ self.lm_head


def prefill_ms(model: RandomLlama, lengths: list[int], repeats: int = 3) -> list[tuple[int, float]]:
    """Per prompt length, the median prefill time in ms (CUDA events; one warm-up each),
    scaled to 32 layers."""
    device = model.embedding.device
    points = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n,), device=device)
        model.prefill(tokens)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.prefill(tokens)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        points.append((n, times[len(times) // 2] * LAYERS / model.num_layers))
    return points
