"""The 16 KV-cache dtypes of the contract (KV_DTYPES.md) and the one table that describes them.

:data:`KV_DTYPES` holds one :class:`KvDtypeRow` per dtype: its K and V side types, its short
alias, how its cache write is launched, which paged-decode and chunked-prefill modules it gets
and for which head_dims, whether it has the tensor-core decode, and how many bf16 boundary layers
it promotes. Everything else (kernel modules, required / launched / validated kernel lists, the
boundary-layer plan) is derived from it; a dtype without a row fails at import.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from metrale_cli.errors import MetraleError

HEAD_DIMS = (64, 128, 256, 512)
"""The head_dims the attention kernels and the WHT rotation are built for."""


class SideType(str, enum.Enum):
    """How one side (K or V) of the cache stores an element."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    TURBO2 = "turbo2"
    TURBO3 = "turbo3"
    TURBO4 = "turbo4"
    TURBO8 = "turbo8"

    @property
    def is_turbo(self) -> bool:
        return self.value.startswith("turbo")


class KvCacheDtype(str, enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    TURBO4 = "turbo4"
    TURBO3 = "turbo3"
    TURBO2 = "turbo2"
    TURBO8 = "turbo8"
    TURBO4K_TURBO3V = "turbo4k_turbo3v"
    TURBO4K_TURBO8V = "turbo4k_turbo8v"
    TURBO3K_TURBO8V = "turbo3k_turbo8v"
    BF16K_TURBO4V = "bf16k_turbo4v"
    BF16K_TURBO3V = "bf16k_turbo3v"
    BF16K_TURBO2V = "bf16k_turbo2v"
    FP8K_TURBO4V = "fp8k_turbo4v"
    FP8K_TURBO3V = "fp8k_turbo3v"
    FP8K_TURBO2V = "fp8k_turbo2v"

    @property
    def row(self) -> KvDtypeRow:
        return KV_DTYPES[self]

    @property
    def suffix(self) -> str:
        """The kernel-name suffix: '' for bf16 (its modules predate the others), else '_<dtype>'."""
        return "" if self is KvCacheDtype.BF16 else f"_{self.value}"


# --- the parts of a row -------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheWrite:
    """How a dtype's cache write is launched: its module, its grid, the pointers it takes."""

    module: str  # reshape_and_cache (bf16 / fp8 / nvfp4) or reshape_and_cache_turbo
    per_head: bool  # grid (T, Hk) with a warp per side (block 64); else (T,), block 128
    scales: bool  # takes the fp8 per-tensor k_scale / v_scale
    rotation: bool  # takes the WHT signs of each side and the InnerQ channel scales


PLAIN_WRITE = CacheWrite("reshape_and_cache", per_head=False, scales=False, rotation=False)
FP8_WRITE = CacheWrite("reshape_and_cache", per_head=False, scales=True, rotation=False)
NVFP4_WRITE = CacheWrite("reshape_and_cache", per_head=True, scales=False, rotation=False)
TURBO_WRITE = CacheWrite("reshape_and_cache_turbo", per_head=True, scales=True, rotation=True)


@dataclass(frozen=True)
class PrefillBuild:
    """The chunked-prefill module ``prefill_paged<suffix>``, entry ``attn_prefill_paged<suffix><tile>``."""

    tile: str  # "_64" or ""
    max_head_dim: int
    required: bool  # listed in KV_DTYPES.md's table (bf16 / fp8 / nvfp4 launch theirs for short chunks only)


@dataclass(frozen=True)
class TensorCoreDecode:
    """``paged_decode_tc``'s decode of a dtype (head_dim 64 / 128; ``paged_decode_tc_wide``'s at 256),
    and whether the dtype also has its one-launch decode attention there (QK-norm + RoPE + write +
    decode + combine)."""

    ctas_per_sm: int  # its __launch_bounds__ minimum
    programmatic: bool  # launched with programmatic dependent launch at batch 1
    one_launch: bool = False
    # The most context splits of a launch (the kernel combines up to TC_MAX_SPLITS): bf16, fp8 and
    # the bf16-K pairs split a batch-1 32k context 60 ways (bf16 186.5 against 181.7 tok/s at 32,
    # fp8 even on an H200); the other packed sides' decodes measured faster at 32 (nvfp4 197.1
    # against 191.9).
    max_splits: int = 32
    # A batch-1 entry (paged_decode_attn_tc_pair<suffix>, head_dim 64 / 128): two tiles a pass at
    # TC_PAIR_CTAS_PER_SM CTAs an SM, launched where the grid fits that (a split's warps then run
    # their tiles one after another, with the SMs half empty).
    pair: bool = False


def _none(_layers: int) -> int:
    return 0


def _third(layers: int) -> int:
    return max(2, math.ceil(layers / 3))


def _four_fifths(layers: int) -> int:
    return max(4, math.ceil(4 * layers / 5))


@dataclass(frozen=True)
class KvDtypeRow:
    """Everything about one KV-cache dtype.

    ``decode``: the paged-decode modules ``paged_decode<suffix><name>`` it gets, as (name, largest
    head_dim): ``_128`` serves head_dim <= 128 where a module without the name exists too, and
    every head_dim it is built for otherwise. ``min_bf16_layers(L)``: the boundary layers kept in
    bf16 even at ``--kv-high-precision-layers 0``.
    """

    k: SideType
    v: SideType
    alias: str | None
    write: CacheWrite
    decode: tuple[tuple[str, int], ...]
    prefill: PrefillBuild
    min_bf16_layers: Callable[[int], int]
    tensor_core: TensorCoreDecode | None = None

    @property
    def rotated(self) -> bool:
        """Some side is stored in the randomized-Hadamard basis (the layer rotates Q / the output)."""
        return self.k.is_turbo or self.v.is_turbo

    @property
    def experimental(self) -> bool:
        return self.rotated

    def decode_module(self, head_dim: int) -> tuple[str, int]:
        """(module name suffix, its largest head_dim) of the decode module serving ``head_dim``."""
        modules = dict(self.decode)
        if "_128" in modules and (head_dim <= 128 or len(modules) == 1):
            return "_128", modules["_128"]
        return "", modules[""]


S, D = SideType, KvCacheDtype
_BOTH = (("_128", 256), ("", 512))  # the _128 module up to 256, the general one up to 512
_SMALL = (("_128", 512),)  # only the _128 module, at every head_dim it serves
_TURBO_PREFILL = PrefillBuild("_64", 512, True)


# The packed sides' tensor-core decode (paged_decode_tc.cu): 4 CTAs an SM (128 registers) where that
# measured faster on an H200, else 3 (turbo8, fp8k_turbo4v, turbo4k_turbo8v spill at 128; turbo4,
# turbo3k_turbo8v and fp8k_turbo2v ran 2-3% slower: up to 168 registers).
_PACKED_TC = TensorCoreDecode(ctas_per_sm=4, programmatic=False)
_PACKED_TC_WIDE = TensorCoreDecode(ctas_per_sm=3, programmatic=False)
# A bf16 K side's decode is bf16's loop (no next tile in flight): at batch 1 it gains from bf16's 64
# splits (qwen3-8b at 32k on an H200: bf16k_turbo4v 184.4 -> 188.5 tok/s, bf16k_turbo2v 186.8 ->
# 190.8; turbo3's and turbo4k_turbo3v's did not gain).
_BF16K_TC = TensorCoreDecode(ctas_per_sm=4, programmatic=False, max_splits=64)
# The 3-bit V sides at 4 CTAs an SM, with the batch-1 pair entry (qwen3-8b at batch 1 and 32k on an
# H200: turbo4k_turbo3v 184.1 -> 186.6 tok/s, fp8k_turbo3v 188.5 -> 193.5; turbo4's and nvfp4's
# layers were slower with one, docs/performance.md).
_PAIR_TC = TensorCoreDecode(ctas_per_sm=4, programmatic=False, pair=True)


def _turbo(k: SideType, v: SideType, alias: str | None, decode=_BOTH, prefill=_TURBO_PREFILL,
           boundary=_third, tc=_PACKED_TC) -> KvDtypeRow:
    return KvDtypeRow(k, v, alias, TURBO_WRITE, decode, prefill, boundary, tc)


KV_DTYPES: dict[KvCacheDtype, KvDtypeRow] = {
    D.BF16: KvDtypeRow(S.BF16, S.BF16, None, PLAIN_WRITE, (("", 512),), PrefillBuild("", 512, False), _none,
                       TensorCoreDecode(ctas_per_sm=4, programmatic=True, one_launch=True, max_splits=64)),
    # fp8's tensor-core decode is bound by instruction issue: launched programmatically it lost 4% at
    # batch 16 and 32k context (1050 vs 1094 tok/s on an H200), so it launches normally.
    D.FP8: KvDtypeRow(S.FP8, S.FP8, None, FP8_WRITE, (("", 512),), PrefillBuild("", 512, False), _none,
                      TensorCoreDecode(ctas_per_sm=3, programmatic=False, one_launch=True, max_splits=64)),
    D.NVFP4: KvDtypeRow(S.NVFP4, S.NVFP4, None, NVFP4_WRITE, (("", 512),), PrefillBuild("", 512, False), _none,
                        _PACKED_TC),
    D.TURBO4: _turbo(S.TURBO4, S.TURBO4, None, tc=_PACKED_TC_WIDE),
    D.TURBO3: _turbo(S.TURBO3, S.TURBO3, None, tc=_PAIR_TC),
    D.TURBO2: _turbo(S.TURBO2, S.TURBO2, None, _SMALL, PrefillBuild("", 512, True), _four_fifths),
    D.TURBO8: _turbo(S.TURBO8, S.TURBO8, None, tc=_PACKED_TC_WIDE),
    D.TURBO4K_TURBO3V: _turbo(S.TURBO4, S.TURBO3, "turbo4k3v", _SMALL, tc=_PAIR_TC),
    D.TURBO4K_TURBO8V: _turbo(S.TURBO4, S.TURBO8, "turbo4k8v", _SMALL, tc=_PACKED_TC_WIDE),
    D.TURBO3K_TURBO8V: _turbo(S.TURBO3, S.TURBO8, "turbo3k8v", _SMALL, tc=_PACKED_TC_WIDE),
    D.BF16K_TURBO4V: _turbo(S.BF16, S.TURBO4, "bf16k4v", tc=_BF16K_TC),
    D.BF16K_TURBO3V: _turbo(S.BF16, S.TURBO3, "bf16k3v", boundary=_four_fifths, tc=_BF16K_TC),
    D.BF16K_TURBO2V: _turbo(S.BF16, S.TURBO2, "bf16k2v", tc=_BF16K_TC),
    D.FP8K_TURBO4V: _turbo(S.FP8, S.TURBO4, "fp8k4v", tc=_PACKED_TC_WIDE),
    D.FP8K_TURBO3V: _turbo(S.FP8, S.TURBO3, "fp8k3v", tc=_PAIR_TC),
    D.FP8K_TURBO2V: _turbo(S.FP8, S.TURBO2, "fp8k2v", tc=_PACKED_TC_WIDE),
}
if set(KV_DTYPES) != set(KvCacheDtype):  # a dtype without a row is a build error, never a fallback
    raise ImportError(f"KV_DTYPES has no row for {sorted(set(KvCacheDtype) - set(KV_DTYPES))}")

ALIASES: dict[str, KvCacheDtype] = {row.alias: d for d, row in KV_DTYPES.items() if row.alias}
ALIASES["fp8_e4m3"] = KvCacheDtype.FP8  # vLLM's spelling of the same e4m3 cache

AUTO = "auto"


def valid_names() -> list[str]:
    """Every accepted spelling: the 16 values, their aliases, and ``auto``."""
    return [d.value for d in KvCacheDtype] + list(ALIASES) + [AUTO]


def parse_kv_cache_dtype(name: str) -> KvCacheDtype | str:
    """Parse a ``--kv-cache-dtype`` value; returns ``AUTO`` unchanged (``ModelConfig`` resolves it)."""
    if isinstance(name, KvCacheDtype):
        return name
    key = name.strip().lower()
    if key == AUTO:
        return AUTO
    if key in ALIASES:
        return ALIASES[key]
    try:
        return KvCacheDtype(key)
    except ValueError:
        raise MetraleError(
            f"Unsupported --kv-cache-dtype '{name}'",
            hint="valid values: " + ", ".join(valid_names()),
        ) from None


def concrete(dtype: KvCacheDtype | str) -> KvCacheDtype:
    """A parsed dtype (aliases accepted); ``auto`` is refused where a concrete one is needed."""
    parsed = parse_kv_cache_dtype(dtype)
    if not isinstance(parsed, KvCacheDtype):
        raise MetraleError("a concrete --kv-cache-dtype is needed here, not 'auto'",
                           hint="valid values: " + ", ".join(d.value for d in KvCacheDtype))
    return parsed


def kv_pair(d: KvCacheDtype) -> tuple[SideType, SideType]:
    """The (K side, V side) storage types of a dtype."""
    row = KV_DTYPES[d]
    return row.k, row.v


def is_asymmetric(d: KvCacheDtype) -> bool:
    k, v = kv_pair(d)
    return k != v


def is_wht_rotated(side: SideType) -> bool:
    """Turbo sides are stored in the randomized-Hadamard basis."""
    return side.is_turbo


def is_experimental(d: KvCacheDtype) -> bool:
    return KV_DTYPES[d].experimental
