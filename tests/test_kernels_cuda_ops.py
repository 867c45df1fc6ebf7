"""CudaOps without a GPU: which kernel each KV dtype launches, with which grid and arguments.

A recording loader stands in for CuPy, so kernel choice, grids, split counts and signatures
(checked against the registry's head dims and the KV_DTYPES.md table) are tested on the CPU.
"""

import re

import numpy as np
import pytest
import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import cuda_attention, cuda_launch, cuda_moe, cuda_ops
from metrale_cli.kernels.cuda_attention import decode_splits
from metrale_cli.kernels.table import TC_LONG_KEYS_PER_SPLIT, TC_MIN_KEYS_PER_SPLIT
from metrale_cli.kernels.kv_kernels import layer_kernels, required_kernels
from metrale_cli.kernels.loader import KernelLoader
from metrale_cli.kernels.registry import module_for
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, is_wht_rotated, kv_pair
from metrale_cli.kv.formats import new_layer_kv

CPU = torch.device("cpu")


class RecordingLoader:
    """Stands in for the CuPy loader: records launches so grids and signatures can be checked."""

    def __init__(self):
        self.calls = []
        self.programmatic = []  # the kernels launched with pdl=True
        self.shared_mem = {}  # dynamic shared memory by kernel, where asked
        self.clusters = {}  # cluster dims by kernel, where asked

    def launch(self, spec, sig, grid, block, *args, shared_mem=0, pdl=False, cluster=(1, 1, 1)):
        assert len(sig.params) == len(args)
        if shared_mem:
            self.shared_mem[str(spec)] = shared_mem
        if cluster != (1, 1, 1):
            assert all(g % c == 0 for g, c in zip(tuple(grid) + (1, 1), cluster))
            self.clusters[str(spec)] = cluster
        if pdl:
            self.programmatic.append(str(spec))
        self.calls.append((str(spec), tuple(grid), tuple(block), dict(zip((n for n, _ in sig.params), args)),
                           dict(sig.params)))


@pytest.fixture
def ops(monkeypatch):
    monkeypatch.setattr(cuda_launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(cuda_attention, "clusters_available", lambda index: True)  # an sm_90 GPU
    for module in (cuda_ops, cuda_attention):
        monkeypatch.setattr(module, "_ready", lambda t: t.contiguous())
    return cuda_ops.CudaOps(RecordingLoader())


def cache(dtype, blocks=64, hk=8, d=128):
    """A CPU layer cache of ``dtype``."""
    return new_layer_kv(KvCacheDtype(dtype), blocks, hk, d, CPU)


def attention(ops, dtype, d=128):
    return ops.paged_attention(KvCacheDtype(dtype), d)


@pytest.mark.parametrize("ctas, max_blocks, splits", [
    (8, 64, 32),  # batch 1: far from a wave, as many splits as allowed
    (8, 4, 2),  # ... but a split keeps at least 32 keys of the table
    (128, 2048, 3),  # 384 CTAs: 97% of one wave of 396
    (512, 67, 3),  # 1 split is 1.29 waves (65% of the last), 2 are 2.59; 3 fill 3.88
    (1024, 67, 3),  # 1 split: 2.59 waves (86% of the last); 2: 5.17 (86%); 3: 7.76 (97%)
])
def test_decode_splits_fill_whole_waves(ops, ctas, max_blocks, splits):
    assert decode_splits(CPU, ctas, max_blocks) == splits


def test_fp8_decode_splits_and_prefill_rows(ops):
    kv = cache("fp8")
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 64, dtype=torch.int32), torch.tensor([999], dtype=torch.int32)
    attention(ops, "fp8").paged_decode(q, kv, tables, lens, 0.1, tensor_cores=False)
    (decode, d_grid, _, d_args, _), (combine, c_grid, _, _, _) = ops.loader.calls
    assert decode == "paged_decode_fp8::paged_decode_attn_fp8" and combine.endswith("paged_decode_combine_fp8")
    # 8 KV heads x 1 sequence x 1 head chunk = 8 CTAs: 32 splits (the cap; 64 blocks * 16 keys
    # would allow 32 splits of 32 keys, and no count makes a wave of 3 x 132 resident CTAs).
    assert d_grid == (8, 1, 32) and d_args["num_splits"] == 32 and c_grid == (32, 1)
    assert d_args["part_o"].shape == (1, 32, 32, 128)
    assert d_args["k_scale"] is kv.k.scale and d_args["k_cache"] is kv.k.data
    ops.loader.calls.clear()
    kv = cache("fp8", d=256)
    attention(ops, "fp8", 256).paged_prefill(torch.zeros(19, 32, 256, dtype=torch.bfloat16), kv, tables[0], 5, 0.1,
                                             use_kernel=True)
    (name, grid, block, args, _), = ops.loader.calls
    assert name == "prefill_paged_fp8::attn_prefill_paged_fp8"
    assert grid == (8, 19 * 4 // 4) and block == (128,) and args["start_pos"] == 5  # 4 rows per CTA at d=256


@pytest.mark.parametrize("dtype, head_dim, decode, prefill", [
    ("turbo4", 128, "paged_decode_tc::paged_decode_attn_tc_turbo4", "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"),
    ("turbo4", 512, "paged_decode_turbo4::paged_decode_attn_turbo4",
     "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"),
    ("turbo2", 256, "paged_decode_tc_wide::paged_decode_attn_tc_turbo2",  # two warps a tile
     "prefill_paged_turbo2::attn_prefill_paged_turbo2"),
    ("nvfp4", 64, "paged_decode_tc::paged_decode_attn_tc_nvfp4", "prefill_paged_nvfp4::attn_prefill_paged_nvfp4"),
    ("bf16k_turbo3v", 512, "paged_decode_bf16k_turbo3v::paged_decode_attn_bf16k_turbo3v",
     "prefill_paged_bf16k_turbo3v::attn_prefill_paged_bf16k_turbo3v_64"),
])
def test_each_dtype_launches_its_table_kernels(ops, dtype, head_dim, decode, prefill):
    kv, attn = cache(dtype, d=head_dim), attention(ops, dtype, head_dim)
    kp, vp = kv.k, kv.v
    q = torch.zeros(2, 16, head_dim, dtype=torch.bfloat16)
    attn.paged_decode(q, kv, torch.zeros(2, 3, dtype=torch.int32), torch.tensor([5, 40], dtype=torch.int32), 0.1)
    attn.paged_prefill(q, kv, torch.zeros(3, dtype=torch.int32), 0, 0.1)
    names = [c[0] for c in ops.loader.calls]
    assert names[0] == decode and names[-1] == prefill
    _, grid, _, args, kinds = ops.loader.calls[0]
    assert grid == (8, 2, args["num_splits"])  # a group of 2 fits one CTA at every head_dim
    want = {SideType.BF16: "bf16*", SideType.FP8: "fp8*"}
    assert kinds["k_cache"] == want.get(kp.side, "u8*") and kinds["v_cache"] == want.get(vp.side, "u8*")
    assert args["v_cache"].dtype == torch.uint8
    assert decode in [str(k) for k in layer_kernels(KvCacheDtype(dtype), head_dim)]


def test_turbo_write_passes_signs_and_innerq_scales_per_head(ops):
    kv = cache("turbo4k_turbo8v", hk=4)
    kp, vp = kv.k, kv.v
    kp.channel_scale = torch.full((4, 128), 1.5)
    k = torch.zeros(7, 4, 128, dtype=torch.bfloat16)
    attention(ops, "turbo4k_turbo8v").reshape_and_cache(k, k.clone(), kv, torch.arange(7, dtype=torch.int32))
    (name, grid, block, args, kinds), = ops.loader.calls
    assert name == "reshape_and_cache_turbo::reshape_and_cache_flash_turbo4k_turbo8v"
    assert grid == (7, 4) and block == (64,)
    assert args["k_signs"] is kp.signs and args["v_signs"] is vp.signs
    assert torch.equal(args["channel_scale"], kp.channel_scale) and args["hk"] == 4 and args["head_dim"] == 128
    assert kinds["channel_scale"] == "f32*?" and kinds["k_cache"] == "u8*"


@pytest.mark.parametrize("dtype, name, grid, block, params", [
    ("bf16", "reshape_and_cache::reshape_and_cache_flash", (7,), (128,), 7),
    ("fp8", "reshape_and_cache::reshape_and_cache_flash_fp8", (7,), (128,), 9),
    ("nvfp4", "reshape_and_cache::reshape_and_cache_flash_nvfp4", (7, 2), (64,), 7),
    ("fp8k_turbo2v", "reshape_and_cache_turbo::reshape_and_cache_flash_fp8k_turbo2v", (7, 2), (64,), 12),
])
def test_write_kernels_and_grids(ops, dtype, name, grid, block, params):
    kv = cache(dtype, hk=2, d=64)
    k = torch.zeros(7, 2, 64, dtype=torch.bfloat16)
    attention(ops, dtype, 64).reshape_and_cache(k, k, kv, torch.arange(7, dtype=torch.int32))
    (got, g, b, args, _), = ops.loader.calls
    assert (got, g, b, len(args)) == (name, grid, block, params)
    assert args["v_cache"] is kv.v.data


def test_wht_rows_grid_and_direction(ops):
    signs = torch.ones(2, 256)
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    assert ops.wht(x, signs, False) is x
    ops.wht(x, signs, True)
    (fwd, grid, block, args, _), (inv, *_rest) = ops.loader.calls
    assert fwd == "wht_bf16::wht_bf16_inplace" and inv == "wht_bf16::wht_bf16_inplace_inv"
    assert grid == (3,) and block == (128,) and args["rows"] == 10 and args["head_dim"] == 256
    with pytest.raises(MetraleError, match="head_dim"):
        ops.wht(torch.zeros(2, 96, dtype=torch.bfloat16), torch.ones(2, 96), False)


def test_norms_and_the_wht_launch_programmatically(ops):
    """They wait in-kernel (test_kernels_compile checks that they trigger only after it), so the
    projection after a norm loads its first weights while the norm runs: batch 16 on an H200 1.2-4%
    faster (docs/performance.md, 2026-12-05)."""
    x, w = torch.ones(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x, w, 1e-6)
    ops.wht(torch.zeros(5, 128, dtype=torch.bfloat16), torch.ones(2, 128), True)
    assert ops.loader.programmatic == ["rmsnorm::rms_norm_bf16", "rmsnorm::add_rms_norm_bf16",
                                       "wht_bf16::wht_bf16_inplace_inv"]


def test_unsupported_shapes_and_caches_are_user_errors(ops):
    with pytest.raises(MetraleError, match="head_dim 96"):
        ops.paged_attention(KvCacheDtype.BF16, 96)
    assert ops.paged_attention(KvCacheDtype.TURBO2, 512).kernels.decode[0].module == "paged_decode_turbo2_128"
    with pytest.raises(MetraleError, match="a bf16 cache of head_dim 128 was given to the turbo2 attention"):
        attention(ops, "turbo2").reshape_and_cache(torch.zeros(1, 8, 128, dtype=torch.bfloat16),
                                                   torch.zeros(1, 8, 128, dtype=torch.bfloat16), cache("bf16"),
                                                   torch.zeros(1, dtype=torch.int32))
    with pytest.raises(MetraleError, match="cannot share"):
        attention(ops, "turbo3").paged_decode(torch.zeros(1, 12, 128, dtype=torch.bfloat16), cache("turbo3"),
                                              torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                              0.1)
    assert ops.paged_attention(KvCacheDtype.FP8, 64) is ops.paged_attention(KvCacheDtype.FP8, 64)  # resolved once


@pytest.mark.parametrize("dtype", list(KvCacheDtype))
def test_layer_kernels_cover_every_side(dtype):
    specs = layer_kernels(dtype, 128)
    names = [str(s) for s in specs]
    fused = dtype in (KvCacheDtype.BF16, KvCacheDtype.FP8)  # + the one-launch decode attention
    assert any(n.startswith("paged_decode_tc::paged_decode_rope_tc") for n in names) == fused
    assert f"paged_decode_tc::paged_decode_attn_tc{dtype.suffix}" in names  # every dtype's tensor-core decode
    pair = dtype.row.tensor_core.pair  # + the batch-1 pair entry
    assert (f"paged_decode_tc::paged_decode_attn_tc_pair{dtype.suffix}" in names) == pair
    assert (f"paged_decode_tc::paged_decode_rope_tc_preload{dtype.suffix}" in names) == fused
    assert len(names) == len(set(names)) == 20 + 2 * any(is_wht_rotated(s) for s in kv_pair(dtype)) + 2 * fused + pair
    assert set(map(str, required_kernels(dtype, 128))) <= set(names)
    assert all(module_for(s) is not None for s in specs)
    assert names[:14] == ["rmsnorm::rms_norm_bf16", "rmsnorm::add_rms_norm_bf16", "rope::rope_neox_bf16",
                          "activation::silu_and_mul_bf16", "gemv::gemv_norm_bf16", "gemv::gemv_norm_logits_bf16",
                          "gemv::gemv_norm_swiglu_bf16", "gemv::gemv_add_bf16", "gemv::gemv_gate_add_bf16",
                          "decode_step::decode_advance",
                          "gemm_rows::gemm_rows_bf16_t1_s4", "gemm_rows::gemm_rows_bf16_t2_s4",
                          "gemm_rows::gemm_rows_bf16_t2_s6", "gemm_rows::gemm_rows_swiglu_bf16"]


def test_launch_checks_arguments_before_touching_cupy():
    spec, sig = cuda_ops.RMS_NORM
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(MetraleError, match="CUDA device"):
        KernelLoader().launch(spec, sig, (2,), (128,), x, x, x, 8, 1e-6)
    assert [kind for _, kind in sig.params] == ["bf16*", "bf16*", "bf16*", "i32", "f32"]


def test_packed_pools_travel_as_byte_pointers():
    from metrale_cli.kernels.loader import _typed

    spec = cuda_ops.RMS_NORM[0]
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    assert _typed(spec, "k_cache", "u8*", pool, CPU) == np.uint64(pool.data_ptr())
    with pytest.raises(MetraleError, match="torch.uint8"):
        _typed(spec, "k_cache", "u8*", pool.view(torch.int8), CPU)
    assert _typed(spec, "k_signs", "f32*?", None, CPU) == np.uint64(0)


@pytest.mark.parametrize("dtype, group, chunks, splits, pair", [
    ("bf16", 4, 1, 16, False),  # 8 CTAs: as many splits as allowed, 64 keys (a tile per warp) each
    ("fp8", 16, 2, 16, False),  # 16 query heads per KV head: two CTAs of 8; still under a wave at 16 splits
    ("turbo4", 4, 1, 16, False),  # a packed cache: the same grid
    ("fp8k_turbo3v", 12, 2, 16, False),  # 256 CTAs, but 64 keys a split: not the pair entry
])
def test_tensor_core_decode_launch(ops, dtype, group, chunks, splits, pair):
    q = torch.zeros(1, 8 * group, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 64, dtype=torch.int32), torch.tensor([999], dtype=torch.int32)
    kv = cache(dtype)
    attention(ops, dtype).paged_decode(q, kv, tables, lens, 0.1)
    (decode, grid, block, args, kinds), = ops.loader.calls  # the splits combined in the launch
    suffix = KvCacheDtype(dtype).suffix
    assert decode == f"paged_decode_tc::paged_decode_attn_tc{'_pair' if pair else ''}{suffix}"
    assert (kinds["k_cache"], kinds["v_cache"]) == {"bf16": ("bf16*",) * 2, "fp8": ("fp8*",) * 2, "turbo4": ("u8*",) * 2,
                                                    "fp8k_turbo3v": ("fp8*", "u8*")}[dtype]
    assert grid == (8, 1, chunks * splits) and block == (128,) and args["num_splits"] == splits
    assert args["counters"].dtype == torch.int32 and args["counters"].numel() >= 8 * chunks
    assert not args["counters"].any() and args["v_signs"] is None
    # all wait in-kernel (pdl.cuh); all but bf16's launch normally (their row's tensor_core.programmatic)
    assert ops.loader.programmatic == ([decode] if dtype == "bf16" else [])
    attention(ops, dtype).paged_decode(q, kv, tables, lens, 0.1, restore_v=True)
    assert ops.loader.calls[1][3]["v_signs"] is (kv.v.signs if kv.v.rotated else None)
    assert len(ops.loader.calls) == 2  # the output rotated back inside the launch


@pytest.mark.parametrize("batch, blocks, splits, pair", [(1, 2048, 32, True), (2, 2048, 30, False),
                                                          (1, 256, 16, True), (1, 255, 16, False), (1, 64, 16, False)])
def test_the_pair_entry_serves_long_grids_of_two_ctas_an_sm(ops, batch, blocks, splits, pair):
    """turbo4k_turbo3v at 32 query heads on 8: batch 1 over a 32k table (256 CTAs, 1,024 keys a
    split) and a 4k one (16 splits of 256) get the pair entry; batch 2's 480 CTAs do not fit two an
    SM of 132; tables of 4,080 and 1,024 keys (16 splits of fewer than 256) keep the dtype's
    entry."""
    q = torch.zeros(batch, 32, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(batch, blocks, dtype=torch.int32), torch.full((batch,), 16 * blocks, dtype=torch.int32)
    attention(ops, "turbo4k_turbo3v").paged_decode(q, cache("turbo4k_turbo3v"), tables, lens, 0.1)
    (decode, grid, _, args, _), = ops.loader.calls
    assert grid == (8, batch, splits) and args["num_splits"] == splits
    assert decode == f"paged_decode_tc::paged_decode_attn_tc{'_pair' if pair else ''}_turbo4k_turbo3v"


@pytest.mark.parametrize("d, launches", [
    (128, ["paged_decode_tc::paged_decode_attn_tc_turbo4", "wht_bf16::wht_bf16_inplace_inv"]),
    (256, ["paged_decode_tc_wide::paged_decode_attn_tc_turbo4", "wht_bf16::wht_bf16_inplace_inv"]),
    (512, ["paged_decode_turbo4::paged_decode_attn_turbo4", "wht_bf16::wht_bf16_inplace_inv"]),
])
def test_one_split_restores_a_rotated_output_with_the_wht_launch(ops, d, launches):
    """A narrow block table (one split: no combine) leaves the rotation to the WHT launch."""
    kv = cache("turbo4", d=d)
    attention(ops, "turbo4", d).paged_decode(torch.zeros(1, 32, d, dtype=torch.bfloat16), kv,
                                             torch.zeros(1, 1, dtype=torch.int32), torch.tensor([9], dtype=torch.int32),
                                             0.1, restore_v=True)
    assert [call[0] for call in ops.loader.calls] == launches
    assert ops.loader.calls[0][3]["num_splits"] == 1 and ops.loader.calls[1][3]["signs"] is kv.v.signs


def test_only_kernels_that_wait_in_kernel_launch_programmatically(ops):
    """The CUDA-core decode (head_dim 512 here) does not call pdl_wait: it must never be launched
    programmatically."""
    q = torch.zeros(1, 32, 512, dtype=torch.bfloat16)
    attention(ops, "turbo3", 512).paged_decode(q, cache("turbo3", d=512), torch.zeros(1, 64, dtype=torch.int32),
                                               torch.tensor([999], dtype=torch.int32), 0.1)
    (decode, *_), (combine, *_) = ops.loader.calls
    assert decode.endswith("paged_decode_attn_turbo3") and combine.endswith("combine_turbo3")
    assert ops.loader.programmatic == []


def test_decode_gemvs_launch_two_ctas_per_sm_programmatically(ops):
    w, x, g = torch.zeros(24, 16, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.bfloat16), torch.ones(16)
    y, s = ops.gemv_norm(x, None, g, 1e-6, w)
    act, _ = ops.gemv_norm_swiglu(x, x, g, 1e-6, w)
    out = ops.gemv_add(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(5, 16, dtype=torch.bfloat16), torch.zeros(1, 5, dtype=torch.bfloat16))
    gate = torch.ones(1, 16, dtype=torch.bfloat16)
    gated = ops.gemv_add(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(5, 16, dtype=torch.bfloat16),
                         torch.zeros(1, 5, dtype=torch.bfloat16), gate)
    assert s is x and y.shape == (1, 24) and act.shape == (1, 12) and out.shape == gated.shape == (1, 5)
    calls = ops.loader.calls
    assert [c[0] for c in calls] == ["gemv::gemv_norm_bf16", "gemv::gemv_norm_swiglu_bf16", "gemv::gemv_add_bf16",
                                     "gemv::gemv_gate_add_bf16"]
    assert all(c[1] == (264,) and c[2] == (256,) for c in calls)
    assert [c[3]["n"] for c in calls] == [24, 12, 5, 5] and calls[0][3]["sum_out"] is None
    assert calls[3][3]["gate"] is gate
    with pytest.raises(MetraleError, match="output gate"):
        ops.gemv_add(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(5, 16, dtype=torch.bfloat16),
                     torch.zeros(1, 5, dtype=torch.bfloat16), torch.ones(1, 8, dtype=torch.bfloat16))
    assert calls[1][3]["sum_out"] is not None and calls[1][3]["residual"] is x
    assert ops.loader.programmatic == [c[0] for c in calls]
    bf16 = torch.bfloat16
    assert not ops.gemv_fits(12, bf16) and ops.gemv_fits(20480, bf16) and not ops.gemv_fits(20488, bf16)
    assert not ops.gemv_fits(16, torch.float32) and not ops.gemv_fits(16, torch.float16)


def test_a_gemv_add_with_no_residual_adds_a_kept_row_of_zeros(ops):
    """A tensor-parallel rank other than 0 (``residual`` None): gemv_add adds a (1, N) row of
    zeros that it keeps, the same buffer at every call (a captured graph replays on it); fp32
    weights are refused."""
    w, x = torch.zeros(5, 16, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.bfloat16)
    ops.gemv_add(x, w, None)
    ops.gemv_add(x, w, None, torch.ones(1, 16, dtype=torch.bfloat16))
    (_, _, _, plain, _), (_, _, _, gated, _) = ops.loader.calls
    zeros = plain["residual"]
    assert zeros.shape == (1, 5) and zeros.dtype == torch.bfloat16 and not zeros.any()
    assert gated["residual"] is zeros
    with pytest.raises(MetraleError, match="bf16 columns"):
        ops.gemv_add(x.float(), w.float(), None)
    with pytest.raises(MetraleError, match="one row"):  # the words test_gemv_gpu.py asks for
        ops.gemv_add(torch.zeros(2, 16, dtype=torch.bfloat16), w, None)


@pytest.mark.parametrize("dtype, max_blocks, splits", [
    ("bf16", 41, 10),  # a 640-key table: 10 splits of 64 keys (a cluster's combine)
    ("bf16", 260, 16),  # 4k: 16 splits, not 64 of 65 keys: past 16 a split holds 256 keys
    ("bf16", 520, 32),  # 8k
    ("bf16", 2051, 60),  # 32k: bf16's 64 splits at most, 60 the fullest wave
    ("turbo4", 260, 16),
    ("turbo4", 2051, 32),  # the packed sides' decodes split at most 32 ways
    ("bf16k_turbo4v", 2051, 60),  # but a bf16 K side's as bf16's
    ("bf16k_turbo2v", 260, 16),
])
def test_a_batch_one_decode_splits_long_contexts_by_256_keys(ops, dtype, max_blocks, splits):
    """Batch 1 of qwen3-8b's 8 KV heads (8 CTAs a split, far from a wave): the split count by the
    table's width."""
    tc = KvCacheDtype(dtype).row.tensor_core
    assert decode_splits(CPU, 8, max_blocks, tc.ctas_per_sm, TC_MIN_KEYS_PER_SPLIT, tc.max_splits,
                         TC_LONG_KEYS_PER_SPLIT) == splits


def test_tensor_core_decode_waves_count_its_residency(ops):
    """bf16's kernel keeps 4 CTAs per SM, fp8's 3: 128 CTAs take 4 and 3 splits for one wave."""
    assert decode_splits(CPU, 128, 2048, KvCacheDtype.BF16.row.tensor_core.ctas_per_sm) == 4
    assert decode_splits(CPU, 128, 2048, KvCacheDtype.FP8.row.tensor_core.ctas_per_sm) == 3


@pytest.mark.parametrize("dtype, launches", [
    ("bf16", ["paged_decode_tc::paged_decode_rope_tc"]),
    ("fp8", ["paged_decode_tc::paged_decode_rope_tc_fp8"]),
    ("turbo4", ["rope_and_cache::rope_and_cache_turbo4", "paged_decode_tc::paged_decode_attn_tc_turbo4"]),
])
def test_decode_attention_is_one_launch_for_a_bf16_or_fp8_cache(ops, dtype, launches):
    """Qwen3-8B's shape at batch 1: one launch of the fused kernel over the grid and split count
    of the tensor-core decode (programmatic for bf16 only, as its row says), q / k / v as
    views of the fused row, counters zeroed and kept; another dtype runs the launches it replaces."""
    from metrale_cli.kernels.cases import rope_decode_args, rope_decode_case

    c = rope_decode_case([999], 32, 8, 128)
    c["block_tables"] = torch.zeros(1, 64, dtype=torch.int32)
    kv = cache(dtype)
    attn = attention(ops, dtype)
    out = attn.rope_cache_decode(*rope_decode_args(c, kv, CPU))
    assert out.shape == (1, 32, 128) and [call[0] for call in ops.loader.calls] == launches
    if dtype == "turbo4":  # the query rotated by the write, the output back by the in-launch combine
        (_, _, _, wargs, _), (_, _, _, dargs, _) = ops.loader.calls
        assert wargs["rotate_q"] == 1 and dargs["v_signs"] is kv.v.signs and dargs["num_splits"] > 1
        return
    (_, grid, block, args, kinds), = ops.loader.calls
    # 8 CTAs, far from a wave at 3 or 4 per SM: as many splits as the table allows (a tile per warp)
    assert grid == (8, 1, 16) and args["num_splits"] == 16 and args["k_scale"] is kv.k.scale
    assert kinds["k_cache"] == f"{dtype}*" and ops.loader.programmatic == (launches if dtype == "bf16" else [])
    assert block == (128,) and args["out"] is out
    assert ops.loader.clusters == {launches[0]: (1, 1, 16)}  # 128 CTAs: each KV head's 16 splits combine in a cluster
    assert args["part_o"].shape == (1, 32, 16, 128) and args["counters"].dtype == torch.int32
    assert not args["counters"].any() and args["counters"].numel() >= 8
    assert args["q"].data_ptr() == c["q"].data_ptr() and args["q_stride"] == 32 * 128  # one token: its own width
    assert args["k"].data_ptr() == c["q"].data_ptr() + 2 * 32 * 128 and args["rot_dim"] == 128
    attn.rope_cache_decode(*rope_decode_args(c, kv, CPU))
    assert ops.loader.calls[1][3]["counters"] is args["counters"]  # one buffer per device: graphs replay on it


@pytest.mark.parametrize("batch, hq, head_dim, preload", [
    ([999], 16, 128, True),  # Qwen3-0.6B's shape at batch 1: two query heads a KV head
    ([999], 8, 64, True),  # one a KV head
    ([999], 24, 128, False),  # three
    ([999, 500], 16, 128, False),  # batch 2
    ([999], 16, 256, False),  # a head of two warps' parts
])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_batch_one_decode_preloads_its_first_tile_where_few_query_heads_share_a_kv_head(ops, dtype, batch, hq,
                                                                                        head_dim, preload):
    """The one launch's _preload entry (each warp's first tile loaded before the PDL wait) serves
    batch 1 where a KV head has at most TC_PRELOAD_MAX_GROUP query heads and a warp holds a head;
    the default entry the rest, over the same grid and arguments. ``preload=`` forces either."""
    from metrale_cli.kernels.cases import rope_decode_args, rope_decode_case

    c = rope_decode_case(batch, hq, 8, head_dim, dtype)
    kv = c["kv"]
    attn = attention(ops, dtype, head_dim)
    module = "paged_decode_tc" if head_dim <= 128 else "paged_decode_tc_wide"
    sfx = KvCacheDtype(dtype).suffix
    default, preloading = f"{module}::paged_decode_rope_tc{sfx}", f"{module}::paged_decode_rope_tc_preload{sfx}"
    attn.rope_cache_decode(*rope_decode_args(c, kv, CPU))
    attn.rope_cache_decode(*rope_decode_args(c, kv, CPU), preload=not preload)
    (first, grid, _, args, _), (second, grid2, _, args2, _) = ops.loader.calls
    assert [first, second] == ([preloading, default] if preload else [default, preloading])
    assert grid == grid2 and args.keys() == args2.keys() and args["num_splits"] == args2["num_splits"]


@pytest.mark.parametrize("items, splits, cluster", [
    (8, 16, 16),  # Qwen3-8B at batch 1: 128 CTAs
    (4, 10, 10),  # Qwen3-30B-A3B at batch 1, context 640
    (4, 2, 2),
    (1, 1, 1),  # not split: nothing to combine
    (4, 17, 1),  # more splits than a cluster may hold
    (9, 16, 1),  # 144 CTAs: more than one an SM
])
def test_few_splits_on_a_small_grid_combine_in_a_cluster(ops, monkeypatch, items, splits, cluster):
    assert cuda_attention.rope_decode_cluster(CPU, items, splits) == cluster
    monkeypatch.setattr(cuda_attention, "clusters_available", lambda index: False)  # no cuda-bindings
    assert cuda_attention.rope_decode_cluster(CPU, items, splits) == 1


@pytest.mark.parametrize("ctas, cluster", [(16, 16), (8, 8), (2, 2), (1, 1), (17, 1), (65, 1)])
def test_a_batch_one_router_of_up_to_16_ctas_is_one_cluster(monkeypatch, ctas, cluster):
    """Qwen3-30B-A3B's 128 experts: 16 CTAs; Qwen1.5-MoE's 60 and a gate: 8; Qwen3-Next's 513: 65."""
    monkeypatch.setattr(cuda_moe, "clusters_available", lambda index: True)
    assert cuda_moe.router_cluster(CPU, ctas) == cluster
    monkeypatch.setattr(cuda_moe, "clusters_available", lambda index: False)
    assert cuda_moe.router_cluster(CPU, ctas) == 1


@pytest.mark.parametrize("static, dynamic, opted_in", [(0, 40_000, False), (20_000, 40_000, True),
                                                      (0, 60_000, True), (20_000, 0, False)])
def test_dynamic_shared_memory_is_opted_into_above_the_limit_left_by_static(static, dynamic, opted_in):
    """The default dynamic limit is 48 KB less the kernel's static shared memory: a kernel with
    both opts in below 48 KB of dynamic memory too, and a function opts in once, not every launch."""
    from types import SimpleNamespace

    from metrale_cli.kernels.loader import KernelLoader

    reads, writes = [], []

    class Fn:
        kernel = SimpleNamespace(ptr=8192)

        @property
        def max_dynamic_shared_size_bytes(self):
            reads.append(1)
            return writes[-1] if writes else 48 * 1024 - static

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value):
            writes.append(value)

    loader, fn = KernelLoader(), Fn()
    for _ in range(3):
        if dynamic:
            loader._allow_dynamic_shared(fn, dynamic)
    assert writes == ([dynamic] if opted_in else [])
    assert len(reads) == (1 if dynamic else 0)


@pytest.mark.parametrize("carveout", [None, 0, 50])
def test_a_loaded_function_asks_for_the_loaders_carveout(monkeypatch, carveout):
    """The layer tools' --carveout: each function, as it is loaded (before any launch or graph
    capture), asks for the loader's carveout; without one, the driver's choice stays untouched."""
    from types import SimpleNamespace

    from metrale_cli.kernels import loader
    from metrale_cli.kernels.registry import KernelSpec

    asked = []

    class Fn:
        @property
        def preferred_shared_memory_carveout(self):
            raise AssertionError("not read")

        @preferred_shared_memory_carveout.setter
        def preferred_shared_memory_carveout(self, value):
            asked.append(value)

    monkeypatch.setattr(loader, "device_index", lambda device: 0)
    kl = loader.KernelLoader(carveout=carveout)
    monkeypatch.setattr(kl, "_module", lambda spec, index: SimpleNamespace(get_function=lambda name: Fn()))
    for _ in range(2):
        kl.function(KernelSpec("gemv", "gemv_add_bf16"), 0)
    kl.function(KernelSpec("gemv", "gemv_norm_bf16"), 0)
    assert asked == ([] if carveout is None else [carveout, carveout])


@pytest.mark.parametrize("cluster_z, opted_in", [(16, True), (8, False), (1, False)])
def test_a_launch_sets_its_attributes_and_opts_into_large_clusters_once(monkeypatch, cluster_z, opted_in):
    """cuLaunchKernelEx's config, built from cuda-bindings' own types with the driver's two calls
    recorded: the programmatic attribute, the cluster's dims along z, and the non-portable opt-in
    for clusters above 8 made once a function, not every launch."""
    from types import SimpleNamespace

    from metrale_cli.kernels import loader

    real = pytest.importorskip("cuda.bindings.driver")
    calls = {"opt_in": [], "launch": []}

    class Driver:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuFuncSetAttribute(self, fn, attribute, value):
            calls["opt_in"].append((attribute, value))
            return (real.CUresult.CUDA_SUCCESS,)

        def cuLaunchKernelEx(self, config, fn, params, extra):
            calls["launch"].append(config)
            return (real.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(loader, "_NON_PORTABLE", set())
    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=4096))
    for _ in range(2):
        loader._launch_ex(Driver(), fn, (4, 1, 32), (128,), 0, 0, [np.int32(7)], True, (1, 1, cluster_z))
    attribute = real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    assert calls["opt_in"] == ([(attribute, 1)] if opted_in else [])
    config = calls["launch"][-1]
    ids = real.CUlaunchAttributeID
    want = [ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    want += [ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION] if cluster_z > 1 else []
    assert [a.id for a in config.attrs] == want and config.numAttrs == len(want)
    if cluster_z > 1:
        dim = config.attrs[1].value.clusterDim
        assert (dim.x, dim.y, dim.z) == (1, 1, cluster_z)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX) == (4, 1, 32, 128)


def test_the_cluster_and_split_limits_mirror_the_kernel_sources():
    from metrale_cli.kernels import table
    from metrale_cli.kernels.registry import KERNELS_DIR

    for source, name in (("paged_decode_tc.cu", "TC_MAX_CLUSTER"), ("include/split_combine.cuh", "TC_MAX_SPLITS"),
                         ("moe.cu", "MOE_ROUTER_CLUSTER")):
        text = (KERNELS_DIR / source).read_text()
        assert int(re.search(rf"^#define {name} (\d+)", text, re.MULTILINE).group(1)) == getattr(table, name)


def test_decode_attention_of_several_tokens_per_sequence_runs_unfused(ops):
    """Two tokens of one sequence (speculative verify) are not a decode step: the launches it replaces."""
    from metrale_cli.kernels.cases import rope_decode_args, rope_decode_case

    c = rope_decode_case([40, 41], 16, 8, 64)
    args = list(rope_decode_args(c, cache("bf16", d=64), CPU))
    args[11] = args[11][:1]  # one block table for two tokens
    attention(ops, "bf16", 64).rope_cache_decode(*args)
    assert [call[0] for call in ops.loader.calls][:2] == ["rope_and_cache::rope_and_cache_bf16",
                                                           "paged_decode_tc::paged_decode_attn_tc"]


@pytest.mark.parametrize("dtype, fused", [("bf16", True), ("fp8", True), ("turbo3", False), ("nvfp4", False)])
def test_head_dim_256_decodes_on_tensor_cores_two_warps_a_tile(ops, dtype, fused):
    """head_dim 256 (Qwen3-Next's and Qwen3.5's attention layers) takes the tensor-core decode of
    paged_decode_tc_wide: bf16 and fp8 in one launch, the packed dtypes after the cache write, with
    the query rotated there for a rotated K side."""
    from metrale_cli.kernels.cases import rope_decode_args, rope_decode_case

    c = rope_decode_case([999], 16, 8, 256)
    c["block_tables"] = torch.zeros(1, 64, dtype=torch.int32)
    kv = cache(dtype, d=256)
    attention(ops, dtype, 256).rope_cache_decode(*rope_decode_args(c, kv, CPU))
    names = [call[0] for call in ops.loader.calls]
    sfx = KvCacheDtype(dtype).suffix
    if fused:
        assert names == [f"paged_decode_tc_wide::paged_decode_rope_tc{sfx}"]
    else:
        assert names == [f"rope_and_cache::rope_and_cache_{dtype}", f"paged_decode_tc_wide::paged_decode_attn_tc{sfx}"]
        assert ops.loader.calls[0][3]["rotate_q"] == int(kv.k.rotated)


def test_decode_attention_past_the_tensor_core_head_dims_rotates_in_its_launches(ops):
    """head_dim 512 has no tensor-core decode: a turbo cache's query is rotated by the cache write
    (rotate_q) and its output rotated back by the split combine (v_signs)."""
    from metrale_cli.kernels.cases import rope_decode_args, rope_decode_case

    c = rope_decode_case([999], 16, 8, 512)
    c["block_tables"] = torch.zeros(1, 64, dtype=torch.int32)
    kv = cache("turbo3", d=512)
    attention(ops, "turbo3", 512).rope_cache_decode(*rope_decode_args(c, kv, CPU))
    (write, _, _, wargs, _), (decode, *_), (combine, _, _, cargs, _) = ops.loader.calls
    assert (write, decode, combine) == ("rope_and_cache::rope_and_cache_turbo3",
                                        "paged_decode_turbo3::paged_decode_attn_turbo3",
                                        "paged_decode_turbo3::paged_decode_combine_turbo3")
    assert wargs["rotate_q"] == 1 and cargs["v_signs"] is kv.v.signs


def test_the_lm_head_gemv_writes_fp32_logits_and_a_bf16_sum(ops):
    """gemv_norm_logits_bf16's launch: the logits an fp32 tensor, the running sum bf16 like x."""
    x, r, g, w = (torch.randn(*shape).to(torch.bfloat16) for shape in ((1, 64), (1, 64), (64,), (40, 64)))
    logits = ops.gemv_norm_logits(x, r, g, 1e-6, w)
    name, _, _, args, types = ops.loader.calls[-1]
    assert name == "gemv::gemv_norm_logits_bf16" and logits.dtype == torch.float32 and logits.shape == (1, 40)
    assert args["out"] is logits and types["out"] == "f32*"
    assert args["sum_out"].dtype == torch.bfloat16 and types["sum_out"] == "bf16*?"
    for name, kind in types.items():  # every tensor's dtype is the one its signature names
        if kind.endswith("*") or kind.endswith("*?"):
            want = {"bf16": torch.bfloat16, "f32": torch.float32}[kind.rstrip("?").rstrip("*")]
            assert args[name] is None or args[name].dtype == want, name


def test_decode_advance_takes_2048_logits_a_cta(ops):
    """Qwen3's 151,936-token vocabulary over 75 CTAs a row; a larger one is capped at 128."""
    from metrale_cli.kernels.ops import StepBuffers

    for vocab, slices in ((151936, 75), (262144, 128), (300000, 128), (1000, 1)):
        step = StepBuffers.zeros(2, 4, CPU)
        ops.decode_advance(torch.zeros(2, vocab), step, 2)
        assert ops.loader.calls[-1][1] == (slices, 2)


@pytest.mark.parametrize("rows, inter, kernel", [
    (1, 768, "moe_gate_up_one_bf16"),  # Qwen3-30B-A3B: 48 column tiles x 8 slots = 384 CTAs, one wave of 3 an SM
    (1, 1408, "moe_gate_up_bf16"),  # Qwen1.5-MoE's 4 routed + 4 shared-chunk slots: 88 x 8 = 704, two waves
    (2, 768, "moe_gate_up_bf16"),  # more rows: 6 CTAs an SM cover the latency
])
def test_batch_one_gate_up_keeps_more_loads_in_flight_where_its_grid_is_one_wave(ops, monkeypatch, rows, inter, kernel):
    """moe_gate_up_one_bf16 (act bit for bit as moe_gate_up_bf16's) holds 3 CTAs an SM: it is
    launched at batch 1 where its grid fits one wave of them (132 SMs here), never where that would
    take two."""
    monkeypatch.setattr(cuda_moe, "_ready", lambda t: t.contiguous())
    experts, hidden, top_k = 8, 64, 8
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    gate_up = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    down = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    ids = torch.zeros(rows, top_k, dtype=torch.int32)
    plan = torch.zeros(2 + 2 * experts + rows * top_k, dtype=torch.int32)
    route = cuda_moe.MoeRoute(ids, torch.zeros(rows, top_k), plan)
    ops.moe_routed(x, route, gate_up, down, None)
    name, grid, block, *_ = ops.loader.calls[0]
    assert (name, grid, block) == (f"moe::{kernel}", (inter // 16, experts), (128,))
    assert ops.loader.calls[1][0] == ("moe::moe_down_one_bf16" if rows == 1 else "moe::moe_down_bf16")


@pytest.mark.parametrize("m, n, k, want", [
    (16, 4096, 4096, (2, 6)),     # Qwen3-8B's o_proj (and down): 128 tiles of 32 columns fill a wave
    (2, 4096, 12288, (2, 6)),
    (16, 6144, 4096, (1, 4)),     # its q/k/v: more 32-column tiles than SMs
    (4, 6144, 4096, (2, 4)),      # ... with few rows, whose x boxes (16 rows) cost the 16-column tiles
    (16, 2048, 4096, (1, 4)),     # Qwen3-30B-A3B's o_proj: 64 tiles, half the SMs
    (7, 2048, 4096, (2, 4)),
    (16, 4096, 1024, (2, 4)),     # Qwen3-0.6B's q/k/v: a wave of tiles, K too short for 6 stages
    (16, 2560, 9728, (2, 4)),     # Qwen3-4B's down: 80 tiles
    (16, 24576, 4096, None),      # gate/up: cuBLAS past 8192 columns
    (16, 5120, 6144, None),       # Qwen3.5-27B's o_proj: 160 tiles and K past 4096
    (1, 16, 256, (2, 4)),
])
def test_gemm_rows_variant_is_the_measured_best_class(m, n, k, want):
    from metrale_cli.kernels.table import gemm_rows_variant

    assert gemm_rows_variant(m, n, k, 132) == want


@pytest.mark.parametrize("n, variant, grid, per_sm", [
    (4096, (2, 6), 128, 1),   # a CTA a tile
    (6144, (1, 4), 384, 3),
    (6144, (2, 4), 192, 2),
    (24576, (2, 4), 264, 2),  # more tiles than resident CTAs: two an SM walk them
    (16, (2, 6), 1, 1),
])
def test_gemm_rows_launch_fits_the_resident_ctas(n, variant, grid, per_sm):
    from metrale_cli.kernels.table import GEMM_ROWS, SM_SHARED_BYTES, gemm_rows_launch, gemm_rows_shared

    spec, shared, got_grid = gemm_rows_launch(n, 132, variant)
    assert spec == GEMM_ROWS[variant] and got_grid == grid
    assert shared == gemm_rows_shared(*variant) and SM_SHARED_BYTES // (shared + 1024) == per_sm


def test_a_tensor_map_goes_by_value():
    """A ``tmap`` parameter: cuda-bindings' CUtensorMap only, and its own 128 bytes' address in the
    launch's parameter array (the kernel takes it by value), the scalars beside it as before."""
    import ctypes
    from types import SimpleNamespace

    from metrale_cli.kernels import loader

    real = pytest.importorskip("cuda.bindings.driver")
    from metrale_cli.kernels.table import GEMM_ROWS, GEMM_ROWS_SIG

    spec, sig = GEMM_ROWS[1, 4], GEMM_ROWS_SIG
    tmap = real.CUtensorMap()
    assert loader._typed(spec, "w_map", "tmap", tmap, CPU) is tmap
    with pytest.raises(MetraleError, match="w_map must be a tensor map"):
        loader._typed(spec, "w_map", "tmap", torch.zeros(4), CPU)
    seen = []

    class Driver:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuLaunchKernelEx(self, config, fn, params, extra):
            array = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            seen.append((array[0], ctypes.cast(array[1], ctypes.POINTER(ctypes.c_int32)).contents.value))
            return (real.CUresult.CUDA_SUCCESS,)

    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=4096))
    loader._launch_ex(Driver(), fn, (1,), (160,), 0, 0, [tmap, np.int32(7)], True)
    assert seen == [(tmap.getPtr(), 7)]
    assert [kind for _, kind in sig.params][:2] == ["tmap", "tmap"]
