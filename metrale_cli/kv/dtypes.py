"""The 16 KV-cache dtypes of the contract (KV_DTYPES.md), their aliases and per-side types."""

from __future__ import annotations

import enum

from metrale_cli.errors import MetraleError


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


ALIASES: dict[str, KvCacheDtype] = {
    "turbo4k3v": KvCacheDtype.TURBO4K_TURBO3V,
    "turbo4k8v": KvCacheDtype.TURBO4K_TURBO8V,
    "turbo3k8v": KvCacheDtype.TURBO3K_TURBO8V,
    "bf16k4v": KvCacheDtype.BF16K_TURBO4V,
    "bf16k3v": KvCacheDtype.BF16K_TURBO3V,
    "bf16k2v": KvCacheDtype.BF16K_TURBO2V,
    "fp8k4v": KvCacheDtype.FP8K_TURBO4V,
    "fp8k3v": KvCacheDtype.FP8K_TURBO3V,
    "fp8k2v": KvCacheDtype.FP8K_TURBO2V,
}

AUTO = "auto"


def valid_names() -> list[str]:
    """Every accepted spelling: the 16 values, their aliases, and ``auto``."""
    return [d.value for d in KvCacheDtype] + list(ALIASES) + [AUTO]


def parse_kv_cache_dtype(name: str) -> KvCacheDtype | str:
    """Parse a ``--kv-cache-dtype`` value; returns ``AUTO`` unchanged for the caller to resolve."""
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


def resolve_auto(checkpoint_kv_dtype: str | None) -> KvCacheDtype:
    """``auto`` = the checkpoint's declared KV dtype, else bf16."""
    if checkpoint_kv_dtype:
        declared = parse_kv_cache_dtype(checkpoint_kv_dtype)
        if declared != AUTO:
            return declared
    return KvCacheDtype.BF16


def kv_pair(d: KvCacheDtype) -> tuple[SideType, SideType]:
    """The (K side, V side) storage types of a dtype."""
    name = d.value
    if "_" not in name:
        side = SideType(name)
        return side, side
    k, v = name.split("_")
    return SideType(k[:-1]), SideType(v[:-1])


def is_asymmetric(d: KvCacheDtype) -> bool:
    k, v = kv_pair(d)
    return k != v


def is_wht_rotated(side: SideType) -> bool:
    """Turbo sides are stored in the randomized-Hadamard basis."""
    return side.is_turbo


def is_experimental(d: KvCacheDtype) -> bool:
    return any(s.is_turbo for s in kv_pair(d))
