"""The kernels of one KV dtype at one head_dim, derived from its row in ``kv/dtypes.KV_DTYPES``.

:func:`kv_kernels` is the one function behind every list: what the start-up check requires
(KV_DTYPES.md's table: :meth:`KvKernels.required`), what a layer launches (:meth:`KvKernels.specs`),
what ``validate-kernels`` checks (:func:`kernels_to_validate`) and whether the dtype serves the
head_dim at all, and why not (:meth:`KvKernels.unserved`). No torch and no CuPy here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from metrale_cli.kernels.registry import KernelSpec, module_for, tc_module
from metrale_cli.kernels.table import (
    COLLECTIVE_KERNELS, COMMON_KERNELS, GDN_KERNELS, MOE_KERNELS, WHT_SIG, Kernel, Signature,
)
from metrale_cli.kv.dtypes import KvCacheDtype, SideType, kv_pair

WHT_KERNELS = (KernelSpec("wht_bf16", "wht_bf16_inplace"), KernelSpec("wht_bf16", "wht_bf16_inplace_inv"))

# Pointer type of a pool's data: element sides by element, packed sides as bytes.
POOL_POINTER = {SideType.BF16: "bf16*", SideType.FP8: "fp8*"}

_WRITE = "k: bf16*, v: bf16*, k_cache: {k}, v_cache: {v}, slot_mapping: i32*"
_WRITE_SCALES = ", k_scale: f32*, v_scale: f32*"
_WRITE_ROTATION = ", k_signs: f32*?, v_signs: f32*?, channel_scale: f32*?"
_WRITE_TAIL = ", hk: i32, head_dim: i32"
_ROPE_WRITE = (
    "q: bf16*, k: bf16*, v: bf16*, q_out: bf16*, k_cache: {k}, v_cache: {v}, slot_mapping: i32*, "
    "positions: i32*, cos: f32*, sin: f32*, q_norm: bf16*?, k_norm: bf16*?, k_scale: f32*, v_scale: f32*, "
    "k_signs: f32*?, v_signs: f32*?, channel_scale: f32*?, q_stride: i32, k_stride: i32, v_stride: i32, "
    "hq: i32, hk: i32, head_dim: i32, rot_dim: i32, eps: f32, rotate_q: i32"
)
_DECODE = (
    "q: bf16*, k_cache: {k}, v_cache: {v}, block_tables: i32*, seq_lens: i32*, out: bf16*, "
    "part_o: f32*?, part_ml: f32*?, k_scale: f32*, v_scale: f32*, scale: f32, hq: i32, hk: i32, "
    "head_dim: i32, max_blocks: i32, num_splits: i32"
)
_DECODE_TC = _DECODE + ", counters: i32*?, v_signs: f32*?"
_DECODE_ROPE = (
    "q: bf16*, k: bf16*, v: bf16*, k_cache: {k}, v_cache: {v}, slot_mapping: i32*, positions: i32*, "
    "cos: f32*, sin: f32*, q_norm: bf16*?, k_norm: bf16*?, block_tables: i32*, seq_lens: i32*, out: bf16*, "
    "part_o: f32*?, part_ml: f32*?, counters: i32*, k_scale: f32*, v_scale: f32*, scale: f32, q_stride: i32, "
    "k_stride: i32, v_stride: i32, hq: i32, hk: i32, head_dim: i32, rot_dim: i32, max_blocks: i32, "
    "num_splits: i32, eps: f32"
)
_PREFILL = (
    "q: bf16*, k_cache: {k}, v_cache: {v}, block_table: i32*, out: bf16*, k_scale: f32*, "
    "v_scale: f32*, scale: f32, tokens: i32, start_pos: i32, hq: i32, hk: i32, head_dim: i32"
)
_COMBINE = (
    "part_o: f32*, part_ml: f32*, seq_lens: i32*, out: bf16*, hq: i32, head_dim: i32, num_splits: i32, "
    "v_signs: f32*?"
)


@dataclass(frozen=True)
class KvKernels:
    """The kernels serving one KV dtype at one head_dim (each a ``(KernelSpec, Signature)``).

    ``decode_tc`` / ``decode_rope``: the tensor-core decode and the one-launch decode attention
    (QK-norm + RoPE + write + decode + combine) where the dtype has them at this head_dim;
    ``decode_rope_preload``: the one-launch entry that loads each warp's first tile before its
    wait (batch 1 where a KV head has few query heads);
    ``decode_tc_pair``: the tensor-core decode's batch-1 entry (two tiles a pass) where the dtype
    has it (head_dim 64 / 128); ``wht``: the Hadamard rotation and its inverse when a side is
    rotated, else empty.
    """

    dtype: KvCacheDtype
    head_dim: int
    write: Kernel
    rope_write: Kernel
    decode: Kernel
    combine: Kernel
    prefill: Kernel
    wht: tuple[Kernel, ...] = ()
    decode_tc: Kernel | None = None
    decode_rope: Kernel | None = None
    decode_tc_pair: Kernel | None = None
    decode_rope_preload: Kernel | None = None

    def required(self) -> list[KernelSpec]:
        """KV_DTYPES.md's row for the dtype: cache write, paged decode, chunked prefill where it
        lists one, the WHT bookends of a rotated side."""
        prefill = [self.prefill[0]] if self.dtype.row.prefill.required else []
        return [self.write[0], self.decode[0], *prefill, *(k[0] for k in self.wht)]

    def specs(self) -> list[KernelSpec]:
        """Every kernel a layer of this dtype launches beyond :data:`COMMON_KERNELS`."""
        tc = [k[0] for k in (self.decode_tc, self.decode_rope, self.decode_rope_preload, self.decode_tc_pair) if k]
        wht = [k[0] for k in self.wht]
        return [self.write[0], self.decode[0], *tc, self.combine[0], self.prefill[0], *wht, self.rope_write[0]]

    def unserved(self) -> dict[str, str]:
        """{``module::function``: why} for every kernel whose module is not built for head_dim."""
        problems = {}
        for spec in self.specs():
            module = module_for(spec)
            if module is not None and module.head_dims is not None and self.head_dim not in module.head_dims:
                problems[str(spec)] = f"built for head_dim {'/'.join(map(str, module.head_dims))} only"
        return problems


def _signature(text: str, d: KvCacheDtype) -> Signature:
    k, v = (POOL_POINTER.get(s, "u8*") for s in kv_pair(d))
    return Signature.parse(text.format(k=k, v=v))


def _write_signature(d: KvCacheDtype) -> Signature:
    write = d.row.write
    params = _WRITE + (_WRITE_SCALES if write.scales else "") + (_WRITE_ROTATION if write.rotation else "")
    return _signature(params + _WRITE_TAIL, d)


@functools.lru_cache(maxsize=None)
def kv_kernels(d: KvCacheDtype, head_dim: int) -> KvKernels:
    """The kernels of dtype ``d`` at ``head_dim``, from its row (whether they serve it or not: see
    :meth:`KvKernels.unserved`)."""
    row, sfx = d.row, d.suffix
    decode_module = f"paged_decode{sfx}{row.decode_module(head_dim)[0]}"
    tc = tc_module(head_dim) if row.tensor_core is not None else None
    pair = KernelSpec(tc, f"paged_decode_attn_tc_pair{sfx}")  # (the registry lists it where it is built)
    one_launch = tc is not None and row.tensor_core.one_launch

    def rope(entry: str) -> Kernel | None:  # a one-launch decode entry, where the dtype has them
        return (KernelSpec(tc, f"{entry}{sfx}"), _signature(_DECODE_ROPE, d)) if one_launch else None

    return KvKernels(
        dtype=d,
        head_dim=head_dim,
        write=(KernelSpec(row.write.module, f"reshape_and_cache_flash{sfx}"), _write_signature(d)),
        rope_write=(KernelSpec("rope_and_cache", f"rope_and_cache_{d.value}"), _signature(_ROPE_WRITE, d)),
        decode=(KernelSpec(decode_module, f"paged_decode_attn{sfx}"), _signature(_DECODE, d)),
        combine=(KernelSpec(decode_module, f"paged_decode_combine{sfx}"), Signature.parse(_COMBINE)),
        prefill=(KernelSpec(f"prefill_paged{sfx}", f"attn_prefill_paged{sfx}{row.prefill.tile}"),
                 _signature(_PREFILL, d)),
        wht=tuple((spec, WHT_SIG) for spec in WHT_KERNELS) if row.rotated else (),
        decode_tc=(KernelSpec(tc, f"paged_decode_attn_tc{sfx}"), _signature(_DECODE_TC, d))
        if tc else None,
        decode_rope=rope("paged_decode_rope_tc"),
        decode_tc_pair=(pair, _signature(_DECODE_TC, d)) if tc and module_for(pair) is not None else None,
        decode_rope_preload=rope("paged_decode_rope_tc_preload"),
    )


def required_kernels(d: KvCacheDtype, head_dim: int) -> list[KernelSpec]:
    """Every kernel KV_DTYPES.md says ``d`` needs at ``head_dim``."""
    return kv_kernels(d, head_dim).required()


def layer_kernels(d: KvCacheDtype, head_dim: int) -> list[KernelSpec]:
    """Every kernel the cuda backend launches for a layer of dtype ``d``: the common ones (norms,
    RoPE, SwiGLU, the decode GEMVs, the decode step's end) and the dtype's."""
    return list(COMMON_KERNELS) + kv_kernels(d, head_dim).specs()


def kernels_to_validate(d: KvCacheDtype, head_dim: int) -> list[KernelSpec]:
    """What ``validate-kernels`` checks, in its table's order: the common kernels, the required
    ones, then the rest a layer launches."""
    kernels = kv_kernels(d, head_dim)
    return list(dict.fromkeys([*COMMON_KERNELS, *kernels.required(), *kernels.specs()]))


def every_kernel() -> list[KernelSpec]:
    """Every kernel any dtype launches at any head_dim it is built for, the MoE FFN's, the
    Gated DeltaNet mixer's and the tensor-parallel ranks' one-shot collectives (what CI compiles)."""
    from metrale_cli.kv.dtypes import HEAD_DIMS

    specs = [*COMMON_KERNELS, *MOE_KERNELS, *GDN_KERNELS, *COLLECTIVE_KERNELS]
    for d in KvCacheDtype:
        for head_dim in HEAD_DIMS:
            kernels = kv_kernels(d, head_dim)
            specs += [s for s in kernels.specs() if str(s) not in kernels.unserved()]
    return list(dict.fromkeys(specs))


def served_head_dims(d: KvCacheDtype) -> tuple[int, ...]:
    """The head_dims at which every kernel of ``d`` is built (the ``_128``-only dtypes stop at 256)."""
    from metrale_cli.kv.dtypes import HEAD_DIMS

    return tuple(hd for hd in HEAD_DIMS if not kv_kernels(d, hd).unserved())
