"""pykvtier.costmodel: the prefill FLOPs against a hand calculation, the GPU and model presets'
figures, the moving bandwidth estimate on a fake clock, and loadable_prefix's exact k at chosen
bandwidths. Pure arithmetic: no disk, no clock, no sleeps."""

from __future__ import annotations

import math

import pytest

from pykvtier import costmodel, models, trace
from pykvtier.costmodel import (
    GPU_PRESETS,
    BandwidthEstimate,
    FixedBandwidth,
    GpuPreset,
    PrefillModel,
    get_gpu,
    loadable_prefix,
)


def test_models_keeps_its_own_copy_of_the_trace_block_size():
    assert models.TRACE_BLOCK_TOKENS == trace.TRACE_BLOCK_TOKENS == 512


def _params(hidden, mlp, layers, q_heads, kv_heads, head_dim, vocab, qkv_bias=False):
    """(params, embedding params) of a Llama-style decoder from its config: per layer Q, K, V,
    O projections (+ QKV biases), the gated MLP's three matrices, two RMSNorms; a final norm;
    untied token embedding and LM head."""
    attn = hidden * q_heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if qkv_bias:
        attn += q_heads * head_dim + 2 * kv_heads * head_dim
    per_layer = attn + 3 * hidden * mlp + 2 * hidden
    emb = 2 * vocab * hidden
    return per_layer * layers + hidden + emb, emb


@pytest.mark.parametrize("name, config, card", [
    # the models' config.json: hidden_size, intermediate_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, head_dim, vocab_size; card: the model card's total
    ("llama-3-8b", (4096, 14336, 32, 32, 8, 128, 128256), 8.03e9),
    ("qwen2.5-7b", (3584, 18944, 28, 28, 4, 128, 152064, True), 7.61e9),
    ("llama-3-70b", (8192, 28672, 80, 64, 8, 128, 128256), 70.6e9),
])
def test_model_presets_parameter_counts_follow_their_configs(name, config, card):
    p = models.get_preset(name)
    params, emb = _params(*config)
    assert (p.params, p.embedding_params) == (params, emb)
    assert p.dense_params == params - emb
    assert p.num_q_heads == config[3] and p.num_layers == config[2] and p.head_dim == config[5]
    assert abs(p.params - card) / card < 0.005


def test_the_presets_keep_their_positional_fields():
    p = models.ModelPreset("x", 4, 2, 64, 2, "d")  # as before the cost model's fields
    assert (p.num_q_heads, p.params, p.embedding_params) == (0, 0, 0)
    assert p.kv_bytes_per_token == 4 * 2 * 64 * 2 * 2
    with pytest.raises(ValueError, match="model preset 'x' has no num_q_heads"):
        PrefillModel(p, "h100")
    with pytest.raises(ValueError, match="model preset 'y' has no usable parameter count"):
        PrefillModel(models.ModelPreset("y", 4, 2, 64, num_q_heads=4), "h100")


def test_gpu_presets_are_the_datasheets_dense_figures():
    assert {n: (g.bf16_flops, g.hbm_bytes_per_s) for n, g in GPU_PRESETS.items()} == {
        "h100": (989.4e12, 3.35e12),  # H100 SXM5: 1,979 TFLOPS bf16 with sparsity / 2
        "h200": (989.4e12, 4.8e12),
        "a100": (312e12, 2.039e12),
        "l40s": (362.05e12, 0.864e12),
    }
    assert get_gpu(" H100 ") is GPU_PRESETS["h100"]
    g = GpuPreset("mine", 1e15, 1e12)
    assert get_gpu(g) is g
    with pytest.raises(ValueError, match=r"unknown GPU preset 'b200'; known GPU presets: "
                                         r"h100, h200, a100, l40s"):
        get_gpu("b200")


def test_block_flops_of_llama_3_8b_by_hand():
    m = PrefillModel("llama-3-8b", "h100", mfu=0.5)
    assert m.model is models.get_preset("llama-3-8b") and m.gpu is GPU_PRESETS["h100"]
    # N = 8,030,261,248 - 1,050,673,152 = 6,979,588,096 weights a token multiplies by;
    # attention per layer and position: 2 matmuls x 2 FLOPs x 32 heads x 128 = 16,384 x (i + 1),
    # x 32 layers = 524,288 x (i + 1).
    # 16 tokens from position 0: dense 2 x 6,979,588,096 x 16 = 223,346,819,072;
    # attention 524,288 x (1 + 2 + ... + 16 = 136) = 71,303,168.
    assert m.block_flops(0, 16) == 223_346_819_072 + 71_303_168 == 223_418_122_240
    # 16 tokens from position 1000: the same dense part; attention 524,288 x (1001 + ... + 1016)
    # = 524,288 x (16 x 1000 + 136) = 524,288 x 16,136 = 8,459,911,168.
    assert m.block_flops(1000, 16) == 223_346_819_072 + 8_459_911_168 == 231_806_730_240
    # seconds at 989.4e12 FLOP/s x 0.5: 223,418,122,240 / 494.7e12 = 451.623 us
    assert m.block_seconds(0, 16) == 223_418_122_240 / (989.4e12 * 0.5)
    assert m.block_seconds(0, 16) == pytest.approx(451.623e-6, rel=1e-5)
    assert m.prefix_seconds(16) == m.block_seconds(0, 16)
    # break-even: 16 x 131,072 B = 2,097,152 B of KV in 451.623 us = 4.6436 GB/s
    assert m.break_even_bytes_per_s(0, 16) == 2_097_152 / m.block_seconds(0, 16)
    assert m.break_even_bytes_per_s(0, 16) == pytest.approx(4.6436e9, rel=1e-4)
    # deeper blocks cost more (attention), so they break even at a lower bandwidth
    assert m.break_even_bytes_per_s(1000, 16) < m.break_even_bytes_per_s(0, 16)
    # the weights' read floor: 2 B x 8,030,261,248 / 3.35e12 B/s = 4.794 ms
    assert m.step_floor_seconds() == pytest.approx(2 * 8_030_261_248 / 3.35e12)


def test_block_flops_add_up_along_the_prompt():
    m = PrefillModel("qwen2.5-7b", "a100")
    for a, b in ((0, 1), (16, 48), (511, 513), (4096, 4096)):
        assert m.block_flops(0, a) + m.block_flops(a, b) == m.block_flops(0, a + b)
    assert m.block_flops(123, 0) == 0.0 and m.block_seconds(5, 0) == 0.0
    assert m.blocks_seconds(32, 16, 3) == [m.block_seconds(32, 16), m.block_seconds(48, 16),
                                           m.block_seconds(64, 16)]


def test_mfu_and_gpus_scale_the_seconds():
    one = PrefillModel("llama-3-70b", "h200", mfu=1.0)
    assert one.block_seconds(0, 512) == one.block_flops(0, 512) / 989.4e12
    half = PrefillModel("llama-3-70b", "h200", mfu=0.5)
    tp4 = PrefillModel("llama-3-70b", "h200", mfu=0.5, gpus=4)
    assert half.block_seconds(0, 512) == pytest.approx(2 * one.block_seconds(0, 512))
    assert tp4.block_seconds(0, 512) == pytest.approx(half.block_seconds(0, 512) / 4)


@pytest.mark.parametrize("kw, match", [
    ({"mfu": 0}, r"mfu must be a number in \(0, 1\]"),
    ({"mfu": 1.5}, r"mfu must be a number in \(0, 1\]"),
    ({"mfu": True}, r"mfu must be a number in \(0, 1\]"),
    ({"mfu": float("nan")}, r"mfu must be a number in \(0, 1\]"),
    ({"gpus": 0}, "gpus must be a positive integer"),
    ({"gpu": "v100"}, "unknown GPU preset 'v100'"),
    ({"model": "gpt-5"}, "unknown model preset 'gpt-5'"),
])
def test_prefill_model_refuses_bad_options(kw, match):
    args = {"model": "llama-3-8b", "gpu": "h100", **kw}
    with pytest.raises(ValueError, match=match):
        PrefillModel(**args)


def test_prefill_model_refuses_bad_positions():
    m = PrefillModel("tiny", "l40s")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            m.block_flops(bad, 16)
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            m.block_flops(0, bad)
    with pytest.raises(ValueError, match="tokens >= 1"):
        m.break_even_bytes_per_s(0, 0)


# ------------------------------------------------------------------------ the bandwidth


def test_bandwidth_estimate_on_a_fake_clock():
    e = BandwidthEstimate()
    assert e.bytes_per_s is None
    e.update(0, 0.0, now=0.0)  # a load refused before any I/O: nothing measured
    assert e.bytes_per_s is None and e.loads == 0
    e.update(1_000_000_000, 1.0, now=10.0)
    assert e.bytes_per_s == 1e9
    # one half-life (5 s) later: the first load weighs 1/2: (0.5e9 + 1e9) / (0.5 + 0.5)
    e.update(1_000_000_000, 0.5, now=15.0)
    assert e.bytes_per_s == 1.5e9 and e.loads == 2
    # an update timed before the latest one is not decayed (nor does it move time back)
    e.update(500_000_000, 0.5, now=12.0)
    assert e.bytes_per_s == 2e9 / 1.5


def test_bandwidth_estimate_initial_value_and_no_decay():
    e = BandwidthEstimate(initial_bytes_per_s=3e9, half_life_s=math.inf)
    assert e.bytes_per_s == 3e9
    e.update(100, 1.0, now=0.0)
    e.update(300, 1.0, now=1e9)
    assert e.bytes_per_s == 200.0  # every load alike; the initial figure no longer counts
    with pytest.raises(ValueError, match="half_life_s must be a number > 0"):
        BandwidthEstimate(half_life_s=0)
    with pytest.raises(ValueError, match="initial_bytes_per_s must be a number > 0"):
        BandwidthEstimate(initial_bytes_per_s=-1)
    with pytest.raises(ValueError, match="seconds must be a number >= 0"):
        e.update(1, -1.0)
    with pytest.raises(ValueError, match="nbytes must be a number >= 0"):
        e.update(float("inf"), 1.0)


def test_fixed_bandwidth_ignores_the_loads():
    f = FixedBandwidth(7e9)
    f.update(10, 1.0, now=0.0)
    assert f.bytes_per_s == 7e9 and f.loads == 1
    assert isinstance(f, BandwidthEstimate)


# ------------------------------------------------------------------------ the rule

U = 2.0 ** -10  # seconds: one block of B bytes at W = 2**30 B/s (binary-exact arithmetic)
B = 1 << 20
W = float(1 << 30)


def test_loadable_prefix_at_chosen_bandwidths():
    # recompute u per block; loading k blocks after Q = 0 bytes takes k x B/W = k x u:
    flat = [U] * 4
    assert loadable_prefix(4, B, 0, W, flat) == 4  # k u <= k u: equal counts as loading
    assert loadable_prefix(4, B, 0, W / 2, flat) == 0  # 2 k u > k u for every k
    assert loadable_prefix(4, B, 0, W * 2, flat) == 4
    assert loadable_prefix(4, B, 1, W, flat) == 0  # one byte queued tips every k
    # growing recompute u, 2u, 3u, 4u (deeper blocks), two blocks queued (Q = 2B):
    # k:           1    2    3    4
    # load (2+k)u: 3u   4u   5u   6u
    # recompute:   1u   3u   6u   10u
    grow = [U, 2 * U, 3 * U, 4 * U]
    assert loadable_prefix(4, B, 2 * B, W, grow) == 4
    assert loadable_prefix(3, B, 2 * B, W, grow) == 3  # 5u <= 6u
    assert loadable_prefix(2, B, 2 * B, W, grow) == 0  # 4u > 3u, 3u > 1u: recompute both
    assert loadable_prefix(1, B, 2 * B, W, grow) == 0
    # recompute that falls (a short last block): 3u, then nothing to recompute
    # k:         1   2   3   4   5
    # load ku:   1u  2u  3u  4u  5u
    # recompute: 3u  3u  3u  3u  3u      -> largest k with ku <= 3u: 3
    assert loadable_prefix(5, B, 0, W, [3 * U, 0, 0, 0, 0]) == 3
    assert loadable_prefix(0, B, 0, W, []) == 0
    assert loadable_prefix(3, B, 10 ** 12, math.inf, [0.0, 0.0, 0.0]) == 3  # free loads
    assert loadable_prefix(2, B, 0, W, [U, U, 99.0]) == 2  # figures past hits are ignored


def test_loadable_prefix_grows_with_bandwidth_and_shrinks_with_the_queue():
    m = PrefillModel("llama-3-8b", "h100")
    r = m.blocks_seconds(0, 16, 64)
    block = 16 * m.model.kv_bytes_per_token
    ks = [loadable_prefix(64, block, 8 * block, gbps * 1e9, r) for gbps in (1, 3, 4, 5, 6, 8, 20)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 64
    qs = [loadable_prefix(64, block, q * block, 6e9, r) for q in (0, 8, 64, 256, 4096)]
    assert qs == sorted(qs, reverse=True) and qs[0] == 64 and qs[-1] == 0


def test_loadable_prefix_for_llama_3_8b_around_break_even():
    """16-token blocks of 2 MiB: block 0 recomputes in 451.623 us and breaks even at 4.6436 GB/s
    (test_block_flops_of_llama_3_8b_by_hand)."""
    m = PrefillModel("llama-3-8b", "h100")
    block = 2_097_152
    r = m.blocks_seconds(0, 16, 8)
    # 5 GB/s: block 0 loads in 2,097,152 / 5e9 = 419.4 us <= 451.6 us, so every prefix does
    assert loadable_prefix(8, block, 0, 5e9, r) == 8
    # 4 GB/s: 524.3 us per block; block j recomputes in 451.6 + 0.271 j us (524,288 x 256
    # FLOPs more per block): the 8 blocks recompute in 3,620.6 us, load in 4,194.3 us -> 0
    assert sum(r) == pytest.approx((8 * 223_418_122_240 + 28 * 134_217_728) / 494.7e12)
    assert loadable_prefix(8, block, 0, 4e9, r) == 0
    # 5 GB/s behind 8 MiB queued: load (4 + k) x 419.4 us vs k x ~452 us: never within 8 blocks
    assert loadable_prefix(8, block, 4 * block, 5e9, r) == 0


@pytest.mark.parametrize("args, match", [
    ((-1, B, 0, W, []), "hits must be an integer >= 0"),
    ((1, 0, 0, W, [U]), "block_bytes must be a positive integer"),
    ((1, B, -1, W, [U]), "queued_bytes must be a number >= 0"),
    ((1, B, 0, 0.0, [U]), "bytes_per_s must be a number > 0"),
    ((2, B, 0, W, [U]), "recompute_seconds has 1 figures for 2 hits"),
    ((1, B, 0, W, [-U]), r"recompute_seconds\[j\] must be a number >= 0"),
])
def test_loadable_prefix_refuses_bad_figures(args, match):
    with pytest.raises(ValueError, match=match):
        loadable_prefix(*args)


def test_the_module_states_its_formulas():
    doc = costmodel.__doc__
    assert "flops(s, t) = 2 * N * t  +  4 * L * H * d * (t * s + t * (t + 1) / 2)" in doc
    assert "(Q + k*B) / W  <=  r[0] + ... + r[k-1]" in doc
