"""The numeric checks behind ``validate-kernels`` on a GPU: each kernel is run through
:class:`~metrale_cli.kernels.cuda_ops.CudaOps` against its torch reference (run on the CPU: the
references define the bytes) or the kernels it fuses, on small odd shapes: bytes equal for cache
writes and the WHT, a row of the tolerance table (``tolerances.py``) otherwise. Imports torch: ``validate.py`` loads this module
only when a check has to run. The fixtures (``cases.py``) are re-exported for the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from metrale_cli.kernels import reference as ref
from metrale_cli.kernels.cases import (  # the fixtures the tests import from here too
    _randn, compare, compare_bytes, decode_advance_case, kv_to, make_paged_case, rope_decode_args,
    rope_decode_case, step_to,
)
from metrale_cli.kernels.tolerances import bounds
from metrale_cli.kv.dtypes import KvCacheDtype


def _gpu(*tensors):
    return [t.cuda() for t in tensors]


def _check_rms(ops, _hd):
    x, w = _randn(7, 200), _randn(200, seed=2)
    return compare(ops.rms_norm(*_gpu(x, w), 1e-6), ref.rms_norm(x, w, 1e-6), *bounds("norm"))


def _check_add_rms(ops, _hd):
    x, r, w = _randn(7, 200), _randn(7, 200, seed=3), _randn(200, seed=2)
    (o, s), (ro, rs) = ops.add_rms_norm(*_gpu(x, r, w), 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
    return compare(s, rs, 0, 0) or compare(o, ro, *bounds("norm"))


def _check_rope(ops, hd):
    q, k = _randn(19, 4, hd), _randn(19, 2, hd, seed=4)
    pos = torch.randint(0, 64, (19,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    ang = torch.arange(64)[:, None] * 0.01 ** (torch.arange(hd // 4) / (hd // 4))
    cos, sin = ang.cos(), ang.sin()  # rot_dim = hd // 2: a partial rotation
    want = ref.rope(q.clone(), k.clone(), pos, cos, sin)
    got = ops.rope(*_gpu(q, k, pos, cos, sin))
    return compare(got[0], want[0], 0, 0) or compare(got[1], want[1], 0, 0)


def _check_silu(ops, _hd):
    gu = _randn(7, 2 * 99) * 3
    return compare(ops.silu_and_mul(gu.cuda()), ref.silu_and_mul(gu), *bounds("silu"))


def _check_decode_advance(ops, _hd):
    """Every buffer equal to the torch reference's after a greedy step (ties, a NaN, signed zeros,
    a row not live, a new block, a table's end) and after a step of sampled tokens."""
    logits, step = decode_advance_case()
    rows = logits.shape[0]
    for given in (logits, None):
        got, want = step_to(step, "cuda"), step_to(step, "cpu")
        ops.decode_advance(None if given is None else given.cuda(), got, rows)
        ref.decode_advance(given, want, rows)
        for f in dataclasses.fields(step):
            if f.name != "keys" and (e := compare_bytes(getattr(got, f.name), getattr(want, f.name))):
                return f"{f.name}: {e}"
    return None


def _check_gemv(kind: str):
    """A decode GEMV against the unfused kernels it replaces and an fp64 product: the prologue's
    sum exact, outputs within fp32 summation error and bf16 rounding."""
    def check(ops, _hd):
        k, n = 1000, 99
        w, x, r, g = _randn(2 * n, k, seed=6) * 0.1, _randn(1, k, seed=7), _randn(1, k, seed=8), _randn(k, seed=9)
        w, x, r, g = _gpu(w, x, r, g)
        if kind == "add":
            w = w[:n]
            got, want = ops.gemv_add(x, w, r[:, :n]), r[:, :n].double() + x.double() @ w.double().T
            return compare(got, want, *bounds("gemv"))
        if kind == "gate":  # the gated row's bytes are torch's; its product as gemv_add's
            gated = x * torch.sigmoid(g[None])
            got, want = ops.gemv_add(x, w[:n], r[:, :n], g[None]), ops.gemv_add(gated, w[:n], r[:, :n])
            return compare_bytes(got, want)
        if kind == "logits":  # the bf16 outputs of gemv_norm, widened
            got, (want, _) = ops.gemv_norm_logits(x, r, g, 1e-6, w), ops.gemv_norm(x, r, g, 1e-6, w)
            return compare_bytes(got, want.float())
        normed, s = ops.add_rms_norm(x, r, g, 1e-6)
        y = normed.double() @ w.double().T
        if kind == "norm":
            got, got_s = ops.gemv_norm(x, r, g, 1e-6, w)
            return compare(got_s, s, 0, 0) or compare(got, y, *bounds("gemv"))
        got, got_s = ops.gemv_norm_swiglu(x, r, g, 1e-6, w)
        want = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
        return compare(got_s, s, 0, 0) or compare(got, want, *bounds("gemv swiglu"))
    return check


def _check_gemm_rows(variant):
    """A projection of 7 rows (gemm_rows.cu, this variant) against the fp64 product: within fp32
    summation error and bf16 rounding; a partial last column tile."""
    def check(ops, _hd):
        w, x = _gpu(_randn(99, 512, seed=10) * 0.1, _randn(7, 512, seed=11))
        return compare(ops.gemm_rows(x, w, variant), x.double() @ w.double().T, *bounds("gemv"))
    return check


def _check_gemm_rows_swiglu(ops, _hd):
    """gate/up + SwiGLU of 7 rows (gemm_rows.cu's SwiGLU entry), I = 48 (a partial grid): the bytes of
    silu_and_mul on the 2/4 variant's product, and within the tolerance of the fp64 product's."""
    w, x = _gpu(_randn(96, 512, seed=12) * 0.1, _randn(7, 512, seed=13))
    got = ops.gemm_rows_swiglu(x, w)
    y = x.double() @ w.double().T
    return (compare_bytes(got, ops.silu_and_mul(ops.gemm_rows(x, w, (2, 4))))
            or compare(got, torch.nn.functional.silu(y[:, :48]) * y[:, 48:], *bounds("gemv swiglu")))


def _check_write(dtype):
    def check(ops, hd):
        c = make_paged_case([40], 4, 2, hd, dtype)
        k, v = _randn(19, 2, hd) * 4, _randn(19, 2, hd, seed=5) * 4
        k[0, 0, :16] = 0.0  # an all-zero group
        slots = torch.randperm(48, generator=torch.Generator().manual_seed(6))[:19].to(torch.int32)
        slots[3] = -1
        mine = kv_to(c["kv"], "cuda")
        ops.paged_attention(dtype, hd).reshape_and_cache(*_gpu(k, v), mine, slots.cuda())
        ref.reshape_and_cache(k, v, c["kv"], slots)
        return compare_bytes(mine.k.data, c["kv"].k.data) or compare_bytes(mine.v.data, c["kv"].v.data)
    return check


def _check_decode(dtype, tensor_cores: bool = False, pair: bool = False):
    def check(ops, hd):
        """Against the reference; the batch-1 pair entry also equal to the tensor-core entry it
        stands in for, bit for bit."""
        c = make_paged_case([1, 19, 599], 8, 2, hd, dtype)
        q = _randn(3, 8, hd)
        attention, kv = ops.paged_attention(dtype, hd), kv_to(c["kv"], "cuda")
        tables = _gpu(c["block_tables"], c["seq_lens"])
        got = attention.paged_decode(q.cuda(), kv, *tables, hd**-0.5, tensor_cores=tensor_cores,
                                     pair=pair if tensor_cores else None)
        want = ref.paged_decode(q, c["kv"], c["block_tables"], c["seq_lens"], hd**-0.5)
        problem = compare(got, want, *bounds("attention"))
        if problem is None and pair:
            problem = compare(got, attention.paged_decode(q.cuda(), kv, *tables, hd**-0.5, pair=False), 0, 0)
        return problem
    return check


def _check_prefill(dtype):
    def check(ops, hd):
        c = make_paged_case([99], 8, 2, hd, dtype)
        q, table = _randn(19, 8, hd), c["block_tables"][0]
        got = ops.paged_attention(dtype, hd).paged_prefill(q.cuda(), kv_to(c["kv"], "cuda"), table.cuda(), 80,
                                                           hd**-0.5, use_kernel=True)
        want = ref.paged_prefill(q, c["kv"], table, 80, hd**-0.5)
        return compare(got, want, *bounds("attention"))
    return check


def _check_wht(inverse: bool):
    def check(ops, hd):
        from metrale_cli.kv.wht import wht_signs

        x, signs = _randn(77, hd) * 3, wht_signs(hd)
        got = ops.wht(x.cuda(), signs.cuda(), inverse)
        return compare_bytes(got, ref.TorchOps.wht(x.clone(), signs, inverse))
    return check


def _check_rope_and_cache(dtype):
    def check(ops, hd):
        """The fused kernel against the unfused kernels it replaces: q and pool bytes equal."""
        attention = ops.paged_attention(dtype, hd)
        c = make_paged_case([40], 8, 2, hd, dtype)
        q, k, v = _randn(19, 8, hd), _randn(19, 2, hd, seed=3) * 4, _randn(19, 2, hd, seed=5) * 4
        pos = torch.randint(0, 64, (19,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
        ang = torch.arange(64)[:, None] * 0.01 ** (torch.arange(hd // 4) / (hd // 4))  # rot_dim = hd // 2
        slots = torch.randperm(48, generator=torch.Generator().manual_seed(6))[:19].to(torch.int32)
        slots[3] = -1
        q, k, v, w, slots, pos, cos, sin = _gpu(q, k, v, _randn(hd), slots, pos, ang.cos(), ang.sin())
        fused, unfused = kv_to(c["kv"], "cuda"), kv_to(c["kv"], "cuda")
        got = attention.rope_and_cache(q, k, v, fused, slots, pos, cos, sin, w, w, 1e-6)
        want, k = ops.rope(ops.rms_norm(q, w, 1e-6), ops.rms_norm(k, w, 1e-6), pos, cos, sin)
        attention.reshape_and_cache(k, v, unfused, slots)
        return (compare(got, want, 0, 0) or compare_bytes(fused.k.data, unfused.k.data)
                or compare_bytes(fused.v.data, unfused.v.data))
    return check


def _check_rope_decode(dtype, preload: bool = False):
    def check(ops, hd):
        """The one-launch decode attention (or its preloading entry) against the launches it
        replaces (rope_and_cache with rotate_q, the tensor-core decode and its combine with
        restore_v): output and cache bytes equal."""
        attention = ops.paged_attention(dtype, hd)
        c = rope_decode_case([1, 19, 599], 8, 2, hd, dtype, seed=7)
        fused, unfused = kv_to(c["kv"], "cuda"), kv_to(c["kv"], "cuda")
        got = attention.rope_cache_decode(*rope_decode_args(c, fused, "cuda"), preload=preload)
        args = rope_decode_args(c, unfused, "cuda")
        want = attention.paged_decode(attention.rope_and_cache(*args[:11], rotate_q=True), *args[3:4], *args[11:],
                                      restore_v=True)
        return (compare(got, want, 0, 0) or compare_bytes(fused.k.data, unfused.k.data)
                or compare_bytes(fused.v.data, unfused.v.data))
    return check


def _numeric_checks() -> dict[str, Callable]:
    """{``module::function``: check(ops, head_dim) -> problem or None} for every kernel."""
    from metrale_cli.kernels.kv_kernels import WHT_KERNELS, kv_kernels
    from metrale_cli.kernels.table import (
        ADD_RMS_NORM, DECODE_ADVANCE, GEMM_ROWS, GEMM_ROWS_SWIGLU, GEMV_ADD, GEMV_GATE_ADD, GEMV_NORM, GEMV_NORM_LOGITS, GEMV_NORM_SWIGLU, RMS_NORM,
        ROPE, SILU_AND_MUL,
    )
    from metrale_cli.kv.dtypes import HEAD_DIMS

    checks = {str(RMS_NORM[0]): _check_rms, str(ADD_RMS_NORM[0]): _check_add_rms,
              str(ROPE[0]): _check_rope, str(SILU_AND_MUL[0]): _check_silu,
              str(GEMV_NORM[0]): _check_gemv("norm"), str(GEMV_NORM_SWIGLU[0]): _check_gemv("swiglu"),
              str(GEMV_NORM_LOGITS[0]): _check_gemv("logits"),
              str(GEMV_ADD[0]): _check_gemv("add"), str(GEMV_GATE_ADD[0]): _check_gemv("gate"),
              str(DECODE_ADVANCE[0]): _check_decode_advance}
    checks.update({str(spec): _check_wht(inverse) for inverse, spec in enumerate(WHT_KERNELS)})
    checks.update({str(spec): _check_gemm_rows(variant) for variant, spec in GEMM_ROWS.items()})
    checks[str(GEMM_ROWS_SWIGLU)] = _check_gemm_rows_swiglu
    for d in KvCacheDtype:
        for hd in HEAD_DIMS:
            kk = kv_kernels(d, hd)
            # the decode check's 599-token context on a 6-CTA grid runs split: it covers combine
            for kernel, check in ((kk.write, _check_write), (kk.decode, _check_decode),
                                  (kk.combine, _check_decode), (kk.prefill, _check_prefill),
                                  (kk.rope_write, _check_rope_and_cache)):
                checks[str(kernel[0])] = check(d)
            if kk.decode_tc is not None:
                checks[str(kk.decode_tc[0])] = _check_decode(d, tensor_cores=True)
            if kk.decode_tc_pair is not None:
                checks[str(kk.decode_tc_pair[0])] = _check_decode(d, tensor_cores=True, pair=True)
            if kk.decode_rope is not None:
                checks[str(kk.decode_rope[0])] = _check_rope_decode(d)
            if kk.decode_rope_preload is not None:
                checks[str(kk.decode_rope_preload[0])] = _check_rope_decode(d, preload=True)
    return checks


NUMERIC_CHECKS: dict[str, Callable] = _numeric_checks()
