"""Model presets: the KV-cache bytes per token of real models, and engine block sizes.

Per-token KV bytes = num_layers x num_kv_heads x head_dim x 2 (K and V) x dtype bytes.
The bf16 numbers (from the models' published configs):

=============  ======  ========  ========  =================
preset         layers  KV heads  head dim  KV bytes / token
=============  ======  ========  ========  =================
llama-3-8b     32      8         128       131,072 (128 KiB)
qwen2.5-7b     28      4         128       57,344 (56 KiB)
llama-3-70b    80      8         128       327,680 (320 KiB)
tiny           2       1         32        256 (synthetic, for tests and smoke runs)
=============  ======  ========  ========  =================

The prefill cost model (:mod:`pykvtier.costmodel`) also needs each model's query heads and
parameter count, from the same configs (``embedding_params``: the token embedding and the LM
head, ``vocab_size x hidden_size`` each, untied in all three; ``params - embedding_params`` is
what a prompt token's forward pass multiplies by, see :mod:`pykvtier.costmodel`):

=============  ========  ==================  ================  ======================
preset         Q heads   params              embedding_params  params - embedding
=============  ========  ==================  ================  ======================
llama-3-8b     32        8,030,261,248       1,050,673,152     6,979,588,096
qwen2.5-7b     28        7,615,616,512       1,089,994,752     6,525,621,760
llama-3-70b    64        70,553,706,496      2,101,346,304     68,452,360,192
tiny           2         251,200             128,000           123,200 (synthetic)
=============  ========  ==================  ================  ======================

(Llama-3-8B: hidden 4096, MLP 14336, vocab 128256; Qwen2.5-7B: hidden 3584, MLP 18944, vocab
152064, QKV biases; Llama-3-70B: hidden 8192, MLP 28672, vocab 128256; each layer's
parameters are its Q/K/V/O projections, its gated MLP's three matrices and two RMSNorms; the
totals match the model cards' 8.03 B, 7.61 B and 70.6 B.)

This module is library (the adapters' ``bypass`` options name a preset): it imports nothing
from pykvtier's tools, so :data:`TRACE_BLOCK_TOKENS` is its own copy of
:data:`pykvtier.trace.TRACE_BLOCK_TOKENS` (tests/test_costmodel.py checks they agree).

A trace block is :data:`~pykvtier.trace.TRACE_BLOCK_TOKENS` (512) tokens; an engine block is
``tokens_per_block`` tokens, which must divide 512, so trace block ``h`` becomes the engine
blocks ``(h, 0) .. (h, 512 // tokens_per_block - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Tokens per trace block (= :data:`pykvtier.trace.TRACE_BLOCK_TOKENS`; see the module docs).
TRACE_BLOCK_TOKENS = 512

__all__ = [
    "ModelPreset",
    "PRESETS",
    "TRACE_BLOCK_TOKENS",
    "UnknownModelError",
    "get_preset",
    "preset_names",
    "validate_tokens_per_block",
    "sub_blocks_per_trace_block",
    "block_size_bytes",
]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """KV-cache geometry of one model, and what the prefill cost model needs of it.

    ``num_q_heads``, ``params`` and ``embedding_params`` (parameter counts, from the model's
    config) default to 0: a preset without them has a KV size but no prefill estimate
    (:class:`pykvtier.costmodel.PrefillModel` refuses it, naming the field)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16
    description: str = ""
    num_q_heads: int = 0  # attention (query) heads
    params: int = 0  # every parameter, embeddings included
    embedding_params: int = 0  # the token embedding and the LM head (one matrix if tied)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, in bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def dense_params(self) -> int:
        """``params - embedding_params``: the weights every prompt token is multiplied by (the
        embedding is a lookup; the LM head runs on a prefill's last token only)."""
        return self.params - self.embedding_params

    def block_size_bytes(self, tokens_per_block: int) -> int:
        """Bytes of one engine block of ``tokens_per_block`` tokens."""
        validate_tokens_per_block(tokens_per_block)
        return self.kv_bytes_per_token * tokens_per_block


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3-8b", 32, 8, 128, 2, "Meta Llama-3-8B, GQA 32 query / 8 KV heads, bf16",
                    num_q_heads=32, params=8_030_261_248, embedding_params=1_050_673_152),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 2, "Qwen2.5-7B, GQA 28 query / 4 KV heads, bf16",
                    num_q_heads=28, params=7_615_616_512, embedding_params=1_089_994_752),
        ModelPreset("llama-3-70b", 80, 8, 128, 2, "Meta Llama-3-70B, GQA 64 query / 8 KV heads, bf16",
                    num_q_heads=64, params=70_553_706_496, embedding_params=2_101_346_304),
        ModelPreset("tiny", 2, 1, 32, 2, "synthetic 256 B/token model for tests and smoke runs",
                    num_q_heads=2, params=251_200, embedding_params=128_000),
    )
}


class UnknownModelError(ValueError):
    """No preset of that name; the message lists the known presets."""


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    """Look a preset up by name (case-insensitive); a :class:`ModelPreset` is returned as is."""
    if isinstance(preset, ModelPreset):
        return preset
    found = PRESETS.get(str(preset).strip().lower())
    if found is None:
        raise UnknownModelError(
            f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}"
        )
    return found


def validate_tokens_per_block(tokens_per_block: int) -> int:
    """Check that ``tokens_per_block`` is a positive integer dividing the trace block (512)."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise ValueError(f"tokens_per_block must be an integer, got {tokens_per_block!r}")
    if tokens_per_block < 1 or TRACE_BLOCK_TOKENS % tokens_per_block:
        divisors = [d for d in range(1, TRACE_BLOCK_TOKENS + 1) if TRACE_BLOCK_TOKENS % d == 0]
        raise ValueError(
            f"tokens_per_block must divide the trace block size ({TRACE_BLOCK_TOKENS} tokens), "
            f"got {tokens_per_block}; valid values: {', '.join(map(str, divisors))}"
        )
    return tokens_per_block


def sub_blocks_per_trace_block(tokens_per_block: int) -> int:
    """Engine blocks per trace block: ``512 // tokens_per_block``."""
    return TRACE_BLOCK_TOKENS // validate_tokens_per_block(tokens_per_block)


def block_size_bytes(preset: str | ModelPreset, tokens_per_block: int) -> int:
    """Bytes of one engine block: KV bytes per token of ``preset`` x ``tokens_per_block``."""
    return get_preset(preset).block_size_bytes(tokens_per_block)
