"""The fused QK-norm + RoPE + cache write (``Ops.rope_and_cache``), checked on the CPU.

- ``TorchOps.rope_and_cache`` equals the unfused sequence the attention layer runs (QK-norm per
  head, RoPE, cache write) byte for byte, for all 16 KV dtypes.
- ``kernels_cu/rope_and_cache.cu`` compiles for sm_90, one entry per dtype, without FMA contraction.
- Host emulation (``kernels_cu/host/rope_and_cache_host.cpp``): the very kernel code, run on the
  CPU on strided views of a fused qkv row, gives exactly the q and cache bytes of the emulated
  unfused kernels (rms_norm_bf16, rope_neox_bf16, then the write, whose bytes equal the codecs by
  test_kernels_host_emulation.py), and matches the torch reference (tolerances below).
- ``CudaOps.rope_and_cache`` with a recording loader: views travel without copies, grid, arguments.
The compiled kernels are checked the same way on an H200 by test_fused_write_gpu.py.
"""

import ctypes

import pytest
import torch

from metrale_cli.errors import MetraleError
from metrale_cli.kernels import compile as kc
from metrale_cli.kernels import cuda_attention, cuda_ops
from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import compare, kv_to
from metrale_cli.kernels.kv_kernels import kv_kernels, layer_kernels
from metrale_cli.kernels.reference import TorchOps
from metrale_cli.kernels.rotation import rotate_query
from metrale_cli.kernels.registry import MODULES
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair
from metrale_cli.kv.formats import new_layer_kv, side_format, token_rows
from test_kernels_cuda_ops import RecordingLoader
from host_build import build_host_library

CPU = torch.device("cpu")
DTYPES = list(KvCacheDtype)  # the host library's dtype numbering
EPS = 1e-6
NORM_TOL = bounds("norm")  # q vs the torch reference with QK-norm


# --- cases shared with test_fused_write_gpu.py --------------------------------------------------
def make_case(dtype, head_dim=128, hq=8, hk=2, tokens=7, rot_dim=None, seed=0, blocks=None):
    """CPU tensors: q / k / v as strided views of one fused qkv projection output, RoPE tables
    (rot_dim < head_dim: partial rotary), QK-norm weights, slots (one token skipped when there
    are several), and a zeroed layer cache ``kv`` (fp8 scales set, random InnerQ scales on a rotated
    K side)."""
    g = torch.Generator().manual_seed(seed)
    blocks = blocks or tokens // 16 + 2
    qkv = (torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g) * 3).to(torch.bfloat16)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    rot = rot_dim or head_dim
    ang = torch.arange(4096)[:, None].float() * 1e4 ** (-torch.arange(0, rot, 2) / rot)[None]
    slots = torch.randperm(blocks * 16, generator=g)[:tokens].to(torch.int32)
    if tokens > 1:
        slots[tokens // 2] = -1  # a prefix-cache skip
    kv = new_layer_kv(KvCacheDtype(dtype), blocks, hk, head_dim, CPU)
    pools = [kv.k, kv.v]
    for pool, scale in zip(pools, (0.02, 0.03)):
        if pool.side == SideType.FP8:
            pool.scale.fill_(scale)
    if pools[0].rotated:
        pools[0].channel_scale = 0.5 + 1.5 * torch.rand(hk, head_dim, generator=g)
    return dict(
        qkv=qkv, q=q.view(tokens, hq, head_dim), k=k.view(tokens, hk, head_dim), v=v.view(tokens, hk, head_dim),
        positions=torch.randint(0, 4096, (tokens,), generator=g, dtype=torch.int32),
        cos=ang.cos(), sin=ang.sin(), slots=slots, kv=kv,
        q_norm=(1 + 0.3 * torch.randn(head_dim, generator=g)).to(torch.bfloat16),
        k_norm=(1 + 0.3 * torch.randn(head_dim, generator=g)).to(torch.bfloat16),
    )


def clone_kv(c, device="cpu"):
    """A copy of the case's (zeroed) layer cache, on ``device``."""
    return kv_to(c["kv"], device)


def unfused(ops, c, kv, q_norm, k_norm):
    """What Qwen3AttentionLayer._prepare runs without the fused op: (q after norm + RoPE, k written)."""
    q, k, v = c["q"], c["k"], c["v"]
    tokens, d = q.shape[0], q.shape[2]
    if q_norm is not None:
        q = ops.rms_norm(q.reshape(-1, d), q_norm, EPS).view(tokens, -1, d)
    if k_norm is not None:
        k = ops.rms_norm(k.reshape(-1, d), k_norm, EPS).view(tokens, -1, d)
    # clones: RoPE runs in place, and a one-token view of qkv is already contiguous
    q, k = ops.rope(q.contiguous().clone(), k.contiguous().clone(), c["positions"], c["cos"], c["sin"])
    ops.paged_attention(kv.dtype, kv.head_dim).reshape_and_cache(k, v.contiguous(), kv, c["slots"])
    return q, k


def fused(ops, c, kv, q_norm, k_norm):
    attention = ops.paged_attention(kv.dtype, kv.head_dim)
    return attention.rope_and_cache(c["q"], c["k"], c["v"], kv, c["slots"], c["positions"], c["cos"], c["sin"],
                                    q_norm, k_norm, EPS)


def vector_bytes(pool):
    """The stored bytes of every (slot, KV head) vector, group scales included: (NB * 16, Hk, bytes)."""
    nb, hk, d = pool.data.shape[0], pool.num_kv_heads, pool.head_dim
    fmt = side_format(pool.side)
    raw = pool.data.cpu().contiguous().view(torch.uint8).reshape(nb, -1)
    if not fmt.packed:
        return token_rows(raw.reshape(nb, hk, 16, -1))
    split = 16 * hk * fmt.data_bytes(d)
    return torch.cat((token_rows(raw[:, :split].reshape(nb, hk, 16, -1)),
                      token_rows(raw[:, split:].reshape(nb, hk, 16, -1))), dim=-1)


def assert_same_bytes(got, want, written_slots):
    """Pools equal byte for byte, and the written slots do hold data (a no-op write cannot pass)."""
    a, b = vector_bytes(got), vector_bytes(want)
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} bytes differ"
    assert int(b[written_slots.long()].count_nonzero()) > 0


def assert_k_matches_reference_where_inputs_agree(pool, ref_pool, k_kernel, k_ref, slots):
    """K written by the kernels vs by the reference: vectors whose roped K (the write's input) is
    the same bf16 in both must hold the same bytes; the norm's 1-ulp differences may change the
    others. Most vectors must be of the first kind."""
    keep = slots >= 0
    same_input = (k_kernel[keep] == k_ref[keep]).all(-1)  # (written tokens, Hk)
    got, want = vector_bytes(pool)[slots[keep].long()], vector_bytes(ref_pool)[slots[keep].long()]
    assert torch.equal(got[same_input], want[same_input])
    assert int(same_input.sum()) >= same_input.numel() // 2


# --- TorchOps: the reference is the unfused sequence ---------------------------------------------
@pytest.mark.parametrize("norms", ["qk", "none", "q"])
@pytest.mark.parametrize("head_dim, rot_dim", [(128, 64), (64, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_torch_rope_and_cache_is_the_unfused_sequence(dtype, head_dim, rot_dim, norms):
    c = make_case(dtype, head_dim, rot_dim=rot_dim, seed=head_dim)
    q_norm = c["q_norm"] if "q" in norms else None
    k_norm = c["k_norm"] if "k" in norms else None
    before = c["qkv"].clone()
    mine, theirs = clone_kv(c), clone_kv(c)
    q = fused(TorchOps, c, mine, q_norm, k_norm)
    want, _ = unfused(TorchOps, c, theirs, q_norm, k_norm)
    assert q.shape == c["q"].shape and q.is_contiguous() and torch.equal(q, want)
    assert not torch.equal(q, c["q"])  # normalized and rotated
    written = c["slots"][c["slots"] >= 0]
    assert_same_bytes(mine.k, theirs.k, written)
    assert_same_bytes(mine.v, theirs.v, written)
    assert torch.equal(c["qkv"], before)  # inputs untouched


# --- the CUDA module -----------------------------------------------------------------------------
def test_module_compiles_for_sm90_with_an_entry_per_dtype():
    module = MODULES["rope_and_cache"]
    assert "--fmad=false" in module.options() and module.head_dims == (64, 128, 256, 512)
    result = kc.check_module(module)
    assert result.ok, result.log
    assert result.symbols == tuple(sorted(f"rope_and_cache_{d.value}" for d in KvCacheDtype))
    assert sorted(str(kv_kernels(d, 128).rope_write[0]) for d in KvCacheDtype) == [
        f"rope_and_cache::{name}" for name in result.symbols]


def test_shared_headers_are_in_every_digest():
    """The norm and RoPE arithmetic live in headers both the fused and the unfused kernels include,
    so an edit to one recompiles all of them."""
    names = {p.name for p in kc.included_sources(MODULES["rope_and_cache"].path.resolve())}
    assert {"rms_row.cuh", "rope.cuh", "kv_write.cuh", "reduce.cuh"} <= names
    assert "rms_row.cuh" in {p.name for p in kc.included_sources(MODULES["rmsnorm"].path.resolve())}
    assert "rope.cuh" in {p.name for p in kc.included_sources(MODULES["rope"].path.resolve())}


# --- host emulation of the kernel code -----------------------------------------------------------
@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return build_host_library("rope_and_cache_host.cpp", tmp_path_factory.mktemp("host"))


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def host_fused(lib, dtype, c, kp, vp, q_norm, k_norm, rotate_q=False):
    tokens, hq, d = c["q"].shape
    hk = c["k"].shape[1]
    (qs, q_stride), (ks, k_stride), (vs, v_stride) = (cuda_attention._head_rows(c[x]) for x in "qkv")
    assert qs.data_ptr() == c["qkv"].data_ptr()  # a view of the qkv row, not a copy
    out = torch.zeros(tokens, hq, d, dtype=torch.bfloat16)
    channel = kp.channel_scale if kp.rotated else None
    args = [_ptr(t) for t in (qs, ks, vs, out, kp.data, vp.data, c["slots"], c["positions"], c["cos"], c["sin"],
                              q_norm, k_norm, kp.scale, vp.scale, kp.signs, vp.signs, channel)]
    ints = [q_stride, k_stride, v_stride, hq, hk, d, c["cos"].shape[1] * 2]
    rc = lib.host_rope_and_cache(DTYPES.index(KvCacheDtype(dtype)), tokens, *args, *ints, ctypes.c_float(EPS),
                                 int(rotate_q))
    assert rc == 0
    return out


def host_rms_norm(lib, x, w):
    out = torch.empty_like(x)
    lib.host_rms_norm(_ptr(x), _ptr(w), _ptr(out), x.numel() // x.shape[-1], x.shape[-1], ctypes.c_float(EPS))
    return out


def host_unfused(lib, c, kv, q_norm, k_norm):
    """rms_norm_bf16 on the q / k heads as rows, rope_neox_bf16, then the write (its bytes are the
    codecs', test_kernels_host_emulation.py): CudaOps' unfused launches, emulated."""
    q, k = c["q"].contiguous(), c["k"].contiguous()
    tokens, hq, d = q.shape
    hk = k.shape[1]
    if q_norm is not None:
        q = host_rms_norm(lib, q, q_norm)
    if k_norm is not None:
        k = host_rms_norm(lib, k, k_norm)
    lib.host_rope(_ptr(q), _ptr(k), _ptr(c["positions"]), _ptr(c["cos"]), _ptr(c["sin"]), tokens, hq, hk, d,
                  c["cos"].shape[1] * 2)
    ref.reshape_and_cache(k, c["v"], kv, c["slots"])
    return q, k


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_host_warp_sum_of_squares_is_the_rmsnorm_blocks(host, head_dim):
    """The fused norm's warp adds the squares in rmsnorm.cu's order (128-thread block, one chunk of
    8 per thread, warp sums, then the block sum), so the fp32 sums are equal, not just close; this
    data is order sensitive (torch's own fp32 sum differs on some rows)."""
    g = torch.Generator().manual_seed(head_dim)
    x = (torch.randn(150, head_dim, generator=g) * torch.randn(150, 1, generator=g).exp() * 3).to(torch.bfloat16)
    block, warp = torch.zeros(150), torch.zeros(150)
    assert host.host_sum_squares(0, _ptr(x), 150, head_dim, _ptr(block)) == 0
    assert host.host_sum_squares(1, _ptr(x), 150, head_dim, _ptr(warp)) == 0
    assert torch.equal(block, warp)
    exact = x.double().pow(2).sum(-1)
    assert torch.allclose(warp.double(), exact, rtol=1e-5, atol=0)
    assert bool((x.float().pow(2).sum(-1) != warp).any())


HOST_CASES = (  # dtype, head_dim, rot_dim, QK-norm, (Hq, Hk), v a view of qkv (else a contiguous copy)
    [(d, 128, 64, True, (8, 2), True) for d in DTYPES]
    + [(d, hd, hd // 2, norm, (6, 2), True) for d in ("bf16", "nvfp4", "turbo3", "fp8k_turbo2v")
       for hd in (64, 256, 512) for norm in (True, False)]
    + [(d, 128, 128, False, (7, 1), False) for d in ("fp8", "turbo4k_turbo8v")]  # an odd query head count
)


@pytest.mark.parametrize("innerq", [True, False], ids=["innerq", "no innerq"])
@pytest.mark.parametrize("dtype, head_dim, heads", [(d.value, hd, (8, 2)) for d in DTYPES if kv_pair(d)[0].is_turbo
                                                    for hd in (64, 128)] + [("turbo3", 256, (6, 2)), ("turbo4", 512, (4, 1))],
                         ids=str)
def test_host_rotate_q_is_the_query_rotation_after_the_kernel(host, dtype, head_dim, heads, innerq):
    """rotate_q: the fused kernel's query is what rotate_query (the WHT launch, then the InnerQ
    division) makes of its unrotated query, byte for byte; the cache bytes do not change."""
    c = make_case(dtype, head_dim, hq=heads[0], hk=heads[1], tokens=5, seed=head_dim + 7)
    plain_kv, rotating_kv = clone_kv(c), clone_kv(c)
    if not innerq:
        plain_kv.k.channel_scale = rotating_kv.k.channel_scale = None
    plain = host_fused(host, dtype, c, plain_kv.k, plain_kv.v, c["q_norm"], c["k_norm"])
    rotated = host_fused(host, dtype, c, rotating_kv.k, rotating_kv.v, c["q_norm"], c["k_norm"], rotate_q=True)
    assert torch.equal(rotated, rotate_query(ref.TorchOps, plain.clone(), plain_kv.k))  # (the WHT is in place)
    assert not torch.equal(rotated, plain)
    written = c["slots"][c["slots"] >= 0]
    assert_same_bytes(rotating_kv.k, plain_kv.k, written)
    assert_same_bytes(rotating_kv.v, plain_kv.v, written)


@pytest.mark.parametrize("dtype, head_dim, rot_dim, norm, heads, v_view", HOST_CASES,
                         ids=lambda x: getattr(x, "value", str(x)))
def test_host_fused_kernel_equals_the_unfused_kernels(host, dtype, head_dim, rot_dim, norm, heads, v_view):
    c = make_case(dtype, head_dim, hq=heads[0], hk=heads[1], tokens=7, rot_dim=rot_dim, seed=head_dim + 1)
    if not v_view:
        c["v"] = c["v"].contiguous()  # as the attention layer passes it
    c["qkv"][0, :head_dim] = 0.0  # an all-zero query head: the norm divides by sqrt(eps)
    c["k"][1, -1, 16:32] = 0.0  # an all-zero group
    q_norm, k_norm = (c["q_norm"], c["k_norm"]) if norm else (None, None)
    fused_kv, unfused_kv, ref_kv = clone_kv(c), clone_kv(c), clone_kv(c)
    fused_pools, unfused_pools, ref_pools = ([kv.k, kv.v] for kv in (fused_kv, unfused_kv, ref_kv))
    got = host_fused(host, dtype, c, *fused_pools, q_norm, k_norm)
    want, k_kernel = host_unfused(host, c, unfused_kv, q_norm, k_norm)
    assert torch.equal(got, want)
    written = c["slots"][c["slots"] >= 0]
    assert_same_bytes(fused_pools[0], unfused_pools[0], written)
    assert_same_bytes(fused_pools[1], unfused_pools[1], written)

    q_ref = ref.rope_and_cache(c["q"], c["k"], c["v"], ref_kv, c["slots"], c["positions"], c["cos"], c["sin"],
                               q_norm, k_norm, EPS)
    assert_same_bytes(fused_pools[1], ref_pools[1], written)  # V: no norm, no RoPE
    if not norm:  # RoPE alone rounds exactly as the reference
        assert torch.equal(got, q_ref)
        assert_same_bytes(fused_pools[0], ref_pools[0], written)
        return
    assert compare(got, q_ref, *NORM_TOL) is None
    k_ref = ref.rope(c["q"], ref.rms_norm(c["k"], k_norm, EPS), c["positions"], c["cos"], c["sin"])[1]
    assert_k_matches_reference_where_inputs_agree(fused_pools[0], ref_pools[0], k_kernel, k_ref, c["slots"])


# --- CudaOps: arguments and grid, through a recording loader -------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "nvfp4", "turbo4k_turbo3v", "fp8k_turbo2v"])
def test_cuda_ops_launch_takes_views_without_copies(dtype):
    ops = cuda_ops.CudaOps(RecordingLoader())
    c = make_case(dtype, 128, hq=7, hk=3, tokens=5)
    out = fused(ops, c, c["kv"], c["q_norm"], c["k_norm"])
    (name, grid, block, args, kinds), = ops.loader.calls
    assert name == f"rope_and_cache::rope_and_cache_{dtype}"
    assert grid == (5, 3 + 4) and block == (64,)  # 3 KV heads + ceil(7 query heads / 2 warps)
    width = c["qkv"].shape[1]
    for x, offset in (("q", 0), ("k", 7 * 128), ("v", 10 * 128)):
        assert args[x].is_contiguous() and args[f"{x}_stride"] == width
        assert args[x].data_ptr() == c["qkv"].data_ptr() + 2 * offset  # no copy
        assert args[x].numel() == 4 * width + (7 if x == "q" else 3) * 128
    assert args["q_out"] is out and out.shape == (5, 7, 128) and out.is_contiguous()
    assert (args["hq"], args["hk"], args["head_dim"], args["rot_dim"]) == (7, 3, 128, 128)
    rotated = c["kv"].k.rotated
    assert (args["channel_scale"] is not None) == rotated and (args["k_signs"] is not None) == rotated
    assert kinds["k_cache"] == {"bf16": "bf16*", "fp8": "fp8*"}.get(kv_pair(KvCacheDtype(dtype))[0].value, "u8*")
    assert args["k_cache"] is c["kv"].k.data and args["v_scale"] is c["kv"].v.scale


def test_cuda_ops_copies_only_what_it_cannot_stride_over():
    ops = cuda_ops.CudaOps(RecordingLoader())
    c = make_case("fp8", 64, hq=4, hk=2, tokens=3)
    q = c["q"].transpose(0, 1).contiguous().transpose(0, 1)  # heads not contiguous within a token
    attention = ops.paged_attention(KvCacheDtype.FP8, 64)
    attention.rope_and_cache(q, c["k"], c["v"], c["kv"], c["slots"], c["positions"], c["cos"], c["sin"], None, None,
                             EPS)
    args = ops.loader.calls[0][3]
    assert args["q"].shape == (3, 4, 64) and args["q_stride"] == 4 * 64 and torch.equal(args["q"], q)
    assert args["q_norm"] is None and args["k_norm"] is None
    one = make_case("fp8", 64, hq=4, hk=2, tokens=1)  # one token: the view is contiguous already
    attention.rope_and_cache(one["q"], one["k"], one["v"], one["kv"], one["slots"], one["positions"], one["cos"],
                             one["sin"], None, None, EPS)
    args = ops.loader.calls[1][3]
    assert args["k"].data_ptr() == one["qkv"].data_ptr() + 2 * 4 * 64 and args["k_stride"] == 2 * 64


def test_cuda_ops_refuses_shapes_the_kernels_do_not_serve():
    ops = cuda_ops.CudaOps(RecordingLoader())
    c = make_case("bf16", 96, hq=4, hk=2, tokens=3)
    with pytest.raises(MetraleError, match="head_dim 96"):
        fused(ops, c, c["kv"], None, None)
    c = make_case("bf16", 64, hq=4, hk=2, tokens=3)
    c["cos"], c["sin"] = torch.zeros(8, 64), torch.zeros(8, 64)  # rot_dim 128 > head_dim 64
    with pytest.raises(MetraleError, match="rotates 128 dims of a 64-wide head"):
        fused(ops, c, c["kv"], None, None)
    empty = make_case("bf16", 64, hq=4, hk=2, tokens=1)
    for x in "qkv":
        empty[x] = empty[x][:0]
    empty["slots"], empty["positions"] = empty["slots"][:0], empty["positions"][:0]
    assert fused(ops, empty, empty["kv"], None, None).shape == (0, 4, 64)
    assert ops.loader.calls == []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_layer_kernels_include_the_fused_write(dtype):
    names = [str(s) for s in layer_kernels(dtype, 128)]
    assert names[-1] == f"rope_and_cache::rope_and_cache_{dtype.value}" and len(set(names)) == len(names)
