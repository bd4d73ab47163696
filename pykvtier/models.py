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

A trace block is :data:`~pykvtier.trace.TRACE_BLOCK_TOKENS` (512) tokens; an engine block is
``tokens_per_block`` tokens, which must divide 512, so trace block ``h`` becomes the engine
blocks ``(h, 0) .. (h, 512 // tokens_per_block - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .trace import TRACE_BLOCK_TOKENS

__all__ = [
    "ModelPreset",
    "PRESETS",
    "UnknownModelError",
    "get_preset",
    "preset_names",
    "validate_tokens_per_block",
    "sub_blocks_per_trace_block",
    "block_size_bytes",
]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """KV-cache geometry of one model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16
    description: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, in bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def block_size_bytes(self, tokens_per_block: int) -> int:
        """Bytes of one engine block of ``tokens_per_block`` tokens."""
        validate_tokens_per_block(tokens_per_block)
        return self.kv_bytes_per_token * tokens_per_block


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3-8b", 32, 8, 128, 2, "Meta Llama-3-8B, GQA 32 query / 8 KV heads, bf16"),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 2, "Qwen2.5-7B, GQA 28 query / 4 KV heads, bf16"),
        ModelPreset("llama-3-70b", 80, 8, 128, 2, "Meta Llama-3-70B, GQA 64 query / 8 KV heads, bf16"),
        ModelPreset("tiny", 2, 1, 32, 2, "synthetic 256 B/token model for tests and smoke runs"),
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
