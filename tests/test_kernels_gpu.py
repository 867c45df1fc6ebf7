"""CUDA kernels vs their torch references on odd shapes (needs an H200 or another sm_90 GPU).

The references of the KV kernels run on the CPU (they define the bytes); the kernels on the GPU.
Tolerances (|got - want| <= atol + rtol·|want|) are the rows of ``kernels/tolerances.py``.
"""

import math

import pytest
import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels import registry
from metrale_cli.kernels.cuda_attention import decode_splits
from metrale_cli.kernels.cases import compare, compare_bytes, fill_turbo8_v, kv_to, make_paged_case
from metrale_cli.kernels.kv_kernels import kv_kernels, served_head_dims
from metrale_cli.kernels.rotation import restore_output
from metrale_cli.kernels.table import TC_LONG_KEYS_PER_SPLIT, TC_MIN_KEYS_PER_SPLIT
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kernels.validate import validate_kernels
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair
from metrale_cli.kv.wht import wht_signs
from tools.layer_variants import use_build

pytestmark = pytest.mark.gpu

TOKENS = (1, 7, 19, 99, 989)
DTYPES = list(KvCacheDtype)


def close(got, want, family):
    problem = compare(got, want, *bounds(family))
    assert problem is None, f"{family}: {problem}"


def randn(*shape, scale=1.0, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)


KV_CASES = [(dtype, d) for dtype in DTYPES for d in served_head_dims(dtype)]


def gpu(case):
    return kv_to(case["kv"], "cuda")


def attention(ops, case):
    kv = case["kv"]
    return ops.paged_attention(kv.dtype, kv.head_dim)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [100, 576, 4096])
def test_rms_norm(ops, tokens, hidden):
    x, w, r = randn(tokens, hidden, scale=3), randn(hidden, seed=1), randn(tokens, hidden, seed=2)
    close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), "norm")
    (out, s), (rout, rs) = ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
    close(s, rs, "store")
    close(out, rout, "norm")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim, rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rope(ops, tokens, head_dim, rot_dim):
    q, k = randn(tokens, 8, head_dim), randn(tokens, 2, head_dim, seed=1)
    pos = torch.randint(0, 4096, (tokens,), dtype=torch.int32).cuda()
    inv = 1e4 ** (-torch.arange(0, rot_dim, 2) / rot_dim)
    ang = torch.arange(4096)[:, None].float() * inv[None]
    cos, sin = ang.cos().cuda(), ang.sin().cuda()
    want_q, want_k = ref.rope(q.clone(), k.clone(), pos, cos, sin)
    got_q, got_k = ops.rope(q.clone(), k.clone(), pos, cos, sin)
    close(got_q, want_q, "rope")
    close(got_k, want_k, "rope")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [99, 1536])
def test_silu_and_mul(ops, tokens, inter):
    gu = randn(tokens, 2 * inter, scale=4)
    close(ops.silu_and_mul(gu), ref.silu_and_mul(gu), "silu")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype, head_dim", KV_CASES)
def test_reshape_and_cache_is_bit_exact(ops, tokens, dtype, head_dim):
    c = make_paged_case([tokens + 40], 8, 2, head_dim, dtype, seed=tokens)
    k = randn(tokens, 2, head_dim, scale=5, device="cpu")
    v = randn(tokens, 2, head_dim, scale=5, seed=1, device="cpu")
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])  # saturates fp8 and group scales
    v[-1, 1, 16:32] = 0.0  # an all-zero group
    slots = torch.randperm(c["kv"].k.num_blocks * 16)[:tokens].to(torch.int32)
    slots[tokens // 2] = -1
    mine = gpu(c)
    attention(ops, c).reshape_and_cache(k.cuda(), v.cuda(), mine, slots.cuda())
    ref.reshape_and_cache(k, v, c["kv"], slots)
    assert compare_bytes(mine.k.data, c["kv"].k.data) is None
    assert compare_bytes(mine.v.data, c["kv"].v.data) is None


ATTN = [(dtype, d, group) for dtype, d in KV_CASES for group in (1, 4, 8)]


def _decode_cases():
    """Every served case on the dtype's paged_decode_attn kernel; the tensor-core kernel's cases
    (bf16 / fp8 at head_dim 64, 128) once more on it, with groups up to its limit of 16."""
    cases = [(dtype, d, group, False) for dtype, d, group in ATTN]
    for dtype, d in KV_CASES:
        if kv_kernels(dtype, d).decode_tc is not None:
            cases += [(dtype, d, group, True) for group in (1, 2, 4, 8, 12, 16)]
    return cases


@pytest.mark.parametrize("dtype, head_dim, group, tensor_cores", _decode_cases())
def test_paged_decode(ops, dtype, head_dim, group, tensor_cores):
    lens = list(TOKENS) + [16, 17, 4099]
    hk = 2
    c = make_paged_case(lens, hk * group, hk, head_dim, dtype, seed=head_dim + group)
    q = randn(len(lens), hk * group, head_dim, seed=3, device="cpu")
    got = attention(ops, c).paged_decode(q.cuda(), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda(),
                                         head_dim**-0.5, tensor_cores=tensor_cores)
    want = ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5)
    close(got, want, "attention")


@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in KV_CASES if kv_kernels(d, hd).decode_tc is not None],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_one_long_sequence_decodes_over_its_most_splits(ops, dtype, head_dim):
    """Batch 1 on two KV heads: the tensor-core decode splits 16,400 keys its most ways (bf16 and
    fp8 64, 61 of them live: two split weights a lane in the combine; the packed sides 32)."""
    hk, group = 2, 4
    c = make_paged_case([16400], hk * group, hk, head_dim, dtype, seed=head_dim + 11)
    attn = attention(ops, c)
    assert decode_splits(torch.device("cuda"), hk, c["block_tables"].shape[1], attn.tc.ctas_per_sm,
                         TC_MIN_KEYS_PER_SPLIT, attn.tc.max_splits, TC_LONG_KEYS_PER_SPLIT) == attn.tc.max_splits
    q = randn(1, hk * group, head_dim, seed=6, device="cpu")
    got = attn.paged_decode(q.cuda(), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda(), head_dim**-0.5)
    close(got, ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5), "attention")


@pytest.mark.parametrize("lens", [[16400], [32768], [1, 19, 599, 4099, 0]], ids=["16400", "32768", "batch"])
@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in KV_CASES if kv_kernels(d, hd).decode_tc_pair],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_the_pair_entry_decodes_as_the_dtype_entry(ops, dtype, head_dim, lens):
    """The batch-1 pair entry (two tiles a pass) against the dtype's tensor-core entry, bit for bit,
    the output rotated back in the launch: batch 1 on 8 KV heads at 16,400 and 32,768 keys (32
    splits, the grid of qwen3-8b's layers at 32k, which the rule gives the pair entry), and a batch
    of odd and empty contexts; in a CUDA graph too."""
    hk, group = 8, 4
    c = make_paged_case(lens, hk * group, hk, head_dim, dtype, seed=head_dim + len(lens))
    q = randn(len(lens), hk * group, head_dim, seed=6)
    attn, kv, tables, seq = attention(ops, c), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda()
    plain = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, restore_v=True, pair=False)
    pair = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, restore_v=True, pair=True)
    assert torch.equal(pair, plain)
    if len(lens) == 1:  # the rule's choice at batch 1
        assert torch.equal(attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, restore_v=True), pair)
    graph, out = torch.cuda.CUDAGraph(), None
    attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, restore_v=True, pair=True)  # warm (loads the kernel)
    with torch.cuda.graph(graph):
        out = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, restore_v=True, pair=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    want = ref.paged_decode(q.cpu(), c["kv"], c["block_tables"], c["seq_lens"], head_dim**-0.5)
    close(attn.paged_decode(q, kv, tables, seq, head_dim**-0.5, pair=True), want, "attention")


@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in KV_CASES if kv_pair(d)[1] == SideType.TURBO8
                                             and kv_kernels(d, hd).decode_tc is not None],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_turbo8_v_in_one_bf16_multiply_equals_the_fp32_way(ops, dtype, head_dim):
    """A turbo8 V side decoded on tensor cores as e4m3 bits read as bf16 times scale x 2^120 in one
    bf16x2 multiply (mul.rn.bf16x2, subnormal e4m3 inputs included) gives the bytes of the fp32
    way, which a build with TC_TURBO8_FACTOR_MAX=0 takes for every tile: every e4m3 code but NaN,
    scales from 2^-117 to 255 and zero, three vectors with a scale of 256 or more."""
    hk, group = 2, 4
    c = make_paged_case([1, 7, 99, 300, 4099], hk * group, hk, head_dim, dtype, seed=head_dim)
    fill_turbo8_v(c, seed=head_dim, wide=3)
    q = randn(5, hk * group, head_dim, seed=5)
    attn, kv, tables, seq = attention(ops, c), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda()
    fast = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5)
    base = dict(registry.MODULES)
    use_build(ops, base, {name: (("TC_TURBO8_FACTOR_MAX", "0"),) for name in base})
    try:
        slow = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5)
    finally:
        use_build(ops, base, {})
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in KV_CASES if hd in (128, 256)
                                             and kv_pair(d)[1] not in (SideType.BF16, SideType.FP8, SideType.TURBO8)
                                             and kv_kernels(d, hd).decode_tc is not None],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_v_scales_from_a_word_a_lane_give_the_byte_loads_bytes(ops, dtype, head_dim):
    """A packed V side's group scales loaded as one word a lane and shuffled to their keys' lanes
    (a build with TC_V_SCALE_WORD=2: every entry it serves) give the bytes of the build that loads
    each key's byte (=0): partial last tiles, several tiles a warp, a split context, an empty one."""
    hk, group = 2, 4
    c = make_paged_case([1, 7, 17, 99, 300, 4099, 0], hk * group, hk, head_dim, dtype, seed=head_dim + 11)
    q = randn(7, hk * group, head_dim, seed=13)
    attn, kv, tables, seq = attention(ops, c), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda()
    base, out = dict(registry.MODULES), {}
    try:
        for word in "20":
            use_build(ops, base, {name: (("TC_V_SCALE_WORD", word),) for name in base})
            out[word] = attn.paged_decode(q, kv, tables, seq, head_dim**-0.5)
    finally:
        use_build(ops, base, {})
    assert torch.isfinite(out["2"][:6]).all()
    assert torch.equal(out["2"], out["0"])


@pytest.mark.parametrize("context", [40, 4099], ids=["narrow table", "split"])
@pytest.mark.parametrize("dtype, head_dim", [(d, hd) for d, hd in KV_CASES if d.row.v.is_turbo],
                         ids=lambda x: getattr(x, "value", str(x)))
def test_paged_decode_restores_a_rotated_output_as_the_wht_launch(ops, dtype, head_dim, context):
    """restore_v: the split combine rotates the output back (or, unsplit, the WHT launch does):
    the bytes of paged_decode then wht_bf16_inplace_inv."""
    hk, group = 2, 4
    lens = [context] if context < 64 else [context, 1, 0]  # a narrow block table: one split on tensor cores
    c = make_paged_case(lens, hk * group, hk, head_dim, dtype, seed=head_dim + context)
    q = randn(len(lens), hk * group, head_dim, seed=5)
    attn, kv, tables, lens = attention(ops, c), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda()
    plain = attn.paged_decode(q, kv, tables, lens, head_dim**-0.5)
    restored = attn.paged_decode(q, kv, tables, lens, head_dim**-0.5, restore_v=True)
    assert torch.equal(restored, restore_output(ops, plain.clone(), kv.v))
    assert not torch.equal(restored, plain)


@pytest.mark.parametrize("dtype, head_dim, group", ATTN)
@pytest.mark.parametrize("tokens, start", [(1, 0), (7, 0), (19, 80), (99, 0), (989, 37)])
def test_paged_prefill(ops, dtype, head_dim, group, tokens, start):
    hk = 2
    c = make_paged_case([start + tokens], hk * group, hk, head_dim, dtype, seed=tokens)
    q = randn(tokens, hk * group, head_dim, seed=4, device="cpu")
    table = c["block_tables"][0]
    got = attention(ops, c).paged_prefill(q.cuda(), gpu(c), table.cuda(), start, head_dim**-0.5, use_kernel=True)
    close(got, ref.paged_prefill(q, c["kv"], table, start, head_dim**-0.5), "attention")


@pytest.mark.parametrize("rows", [n * 4 for n in TOKENS])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_wht_is_bit_exact_and_round_trips(ops, rows, head_dim):
    x, signs = randn(rows, head_dim, scale=3, device="cpu"), wht_signs(head_dim)
    fwd = ops.wht(x.cuda(), signs.cuda(), False)
    assert compare_bytes(fwd, ref.TorchOps.wht(x.clone(), signs, False)) is None
    back = ops.wht(fwd.clone(), signs.cuda(), True)
    assert compare_bytes(back, ref.TorchOps.wht(fwd.cpu(), signs, True)) is None
    close(back, x, "round trip")
    view = x.cuda().t().contiguous().t()  # a non-contiguous input is rotated in place too
    assert ops.wht(view, signs.cuda(), False) is view
    assert compare_bytes(view.contiguous(), fwd) is None


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.NVFP4, KvCacheDtype.TURBO3])
def test_empty_sequence_decodes_to_zero(ops, dtype):
    c = make_paged_case([0, 5], 8, 2, 128, dtype)
    out = attention(ops, c).paged_decode(randn(2, 8, 128), gpu(c), c["block_tables"].cuda(), c["seq_lens"].cuda(), 0.1)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", [KvCacheDtype.BF16, KvCacheDtype.FP8, KvCacheDtype.TURBO4,
                                   KvCacheDtype.FP8K_TURBO2V, KvCacheDtype.TURBO3K_TURBO8V])
def test_launch_inside_a_cuda_graph_replays(ops, dtype):
    hk, group, d, batch = 2, 4, 128, 3
    c = make_paged_case([700, 300, 33], hk * group, hk, d, dtype)
    kv, attn = gpu(c), attention(ops, c)
    q, k, v = randn(batch, hk * group, d), randn(batch, hk, d, seed=1), randn(batch, hk, d, seed=2)
    lens, tables = c["seq_lens"].cuda(), c["block_tables"].cuda()
    slots = torch.stack([c["block_tables"][b, (n - 1) // 16] * 16 + (n - 1) % 16
                         for b, n in enumerate(c["seq_lens"].tolist())]).int()
    slots_gpu = slots.cuda()

    def step():
        attn.reshape_and_cache(k, v, kv, slots_gpu)
        return attn.paged_decode(q, kv, tables, lens, d**-0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles and loads outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (10, 11):  # new inputs in the static buffers, then replay
        q.copy_(randn(*q.shape, seed=seed))
        k.copy_(randn(*k.shape, seed=seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        ref.reshape_and_cache(k.cpu(), v.cpu(), c["kv"], slots)
        assert compare_bytes(kv.k.data, c["kv"].k.data) is None
        want = ref.paged_decode(q.cpu(), c["kv"], c["block_tables"], c["seq_lens"], d**-0.5)
        close(out, want, "attention")
        assert not math.isnan(out.float().sum().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_validate_kernels_on_gpu(dtype, head_dim):
    report = validate_kernels(dtype, head_dim, recheck=True)
    assert report.on_gpu
    assert report.ok, [r for r in report.rows if not r.ok]
    assert {r.numeric for r in report.rows} == {"matches reference"}


@pytest.mark.parametrize("rows,vocab", [(6, 20011), (1, 151936), (6, 5), (64, 151936), (3, 262144)])
def test_decode_advance_equals_the_reference(ops, rows, vocab):
    """Every buffer byte for byte after a greedy step and after a sampled one (the fixture's ties,
    NaN and signed zeros in the first rows), three launches in a row: the counters come back to 0."""
    import dataclasses

    from metrale_cli.kernels.cases import decode_advance_case, step_to

    logits, step = decode_advance_case(rows=max(rows, 6), vocab=max(vocab, 20011), seed=rows)
    logits, step = logits[:rows, :vocab].contiguous(), step_to(step, "cpu")
    for given in (logits, None, logits):
        got = step_to(step, "cuda")
        ops.decode_advance(None if given is None else given.cuda(), got, rows)
        ref.decode_advance(given, step, rows)
        for f in dataclasses.fields(step):
            if f.name != "keys":
                assert compare_bytes(getattr(got, f.name), getattr(step, f.name)) is None, f.name
        assert not got.counters.any()
