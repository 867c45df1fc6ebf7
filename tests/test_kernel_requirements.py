"""The KV-dtype -> kernels table of KV_DTYPES.md and the start-up check built on it."""

import pytest

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.requirements import (
    REQUIREMENTS,
    missing_kernels,
    required_kernels,
    validate_required_kv_kernels,
)
from metrale_cli.kernels.validate import SKIPPED, validate_kernels
from metrale_cli.kv.dtypes import KvCacheDtype

WHT = ["wht_bf16::wht_bf16_inplace", "wht_bf16::wht_bf16_inplace_inv"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "metrale-cache"))


def names(dtype, head_dim):
    return [str(k) for k in required_kernels(dtype, head_dim)]


def test_every_dtype_has_a_row():
    assert set(REQUIREMENTS) == set(KvCacheDtype)
    for d in KvCacheDtype:
        assert len(names(d, 128)) >= 2


@pytest.mark.parametrize(
    "dtype, head_dim, expected",
    [
        ("bf16", 128, ["reshape_and_cache::reshape_and_cache_flash", "paged_decode::paged_decode_attn"]),
        ("fp8", 256, ["reshape_and_cache::reshape_and_cache_flash_fp8", "paged_decode_fp8::paged_decode_attn_fp8"]),
        ("nvfp4", 64, ["reshape_and_cache::reshape_and_cache_flash_nvfp4", "paged_decode_nvfp4::paged_decode_attn_nvfp4"]),
        ("turbo4", 128, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4",
                         "paged_decode_turbo4_128::paged_decode_attn_turbo4",
                         "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"] + WHT),
        ("turbo4", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4",
                         "paged_decode_turbo4::paged_decode_attn_turbo4",
                         "prefill_paged_turbo4::attn_prefill_paged_turbo4_64"] + WHT),
        ("turbo2", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo2",
                         "paged_decode_turbo2_128::paged_decode_attn_turbo2",
                         "prefill_paged_turbo2::attn_prefill_paged_turbo2"] + WHT),
        ("turbo4k3v", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_turbo4k_turbo3v",
                            "paged_decode_turbo4k_turbo3v_128::paged_decode_attn_turbo4k_turbo3v",
                            "prefill_paged_turbo4k_turbo3v::attn_prefill_paged_turbo4k_turbo3v_64"] + WHT),
        ("fp8k_turbo2v", 256, ["reshape_and_cache_turbo::reshape_and_cache_flash_fp8k_turbo2v",
                               "paged_decode_fp8k_turbo2v::paged_decode_attn_fp8k_turbo2v",
                               "prefill_paged_fp8k_turbo2v::attn_prefill_paged_fp8k_turbo2v_64"] + WHT),
    ],
)
def test_exact_required_lists(dtype, head_dim, expected):
    assert names(dtype, head_dim) == expected


def test_missing_kernels_reports_every_reason_not_the_first():
    seen = []

    def nothing_works(spec):
        seen.append(str(spec))
        return "broken"

    assert missing_kernels("turbo3", 128, nothing_works) == names("turbo3", 128)
    assert seen == names("turbo3", 128)
    assert missing_kernels("turbo3", 128, lambda spec: None) == []


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_bf16_and_fp8_validate_clean_on_cpu(dtype):
    kernels = validate_required_kv_kernels(dtype, 128)
    assert [str(k) for k in kernels] == names(dtype, 128)
    report = validate_kernels(dtype, 128, on_gpu=False)
    assert report.ok
    assert {r.numeric for r in report.rows} == {SKIPPED}
    assert {r.symbol for r in report.rows} == {"exported"}
    assert len(report.rows) == 8  # 4 dtype-independent + write, decode, split combine, prefill


def test_turbo3_fails_with_the_full_list_in_one_message():
    with pytest.raises(MetraleError) as info:
        validate_required_kv_kernels(KvCacheDtype.TURBO3, 128)
    assert info.value.message == (
        "kv-cache-dtype turbo3 (head_dim 128) requires kernel(s) missing from this build: "
        "reshape_and_cache_turbo::reshape_and_cache_flash_turbo3, "
        "paged_decode_turbo3_128::paged_decode_attn_turbo3, "
        "prefill_paged_turbo3::attn_prefill_paged_turbo3_64, "
        "wht_bf16::wht_bf16_inplace, wht_bf16::wht_bf16_inplace_inv (turbo3 is experimental)"
    )
    assert "not in this build" in info.value.hint


def test_nvfp4_is_reported_missing_and_not_experimental():
    with pytest.raises(MetraleError) as info:
        validate_required_kv_kernels("nvfp4", 64)
    assert info.value.message.endswith(
        "reshape_and_cache::reshape_and_cache_flash_nvfp4, paged_decode_nvfp4::paged_decode_attn_nvfp4"
    )


def test_validate_report_rows_for_a_missing_dtype():
    progress = []
    report = validate_kernels("turbo3", 128, progress=lambda k, i, n: progress.append((i, n)), on_gpu=False)
    assert not report.ok
    assert progress == [(i, 9) for i in range(9)]
    missing = [r.kernel for r in report.rows if not r.ok]
    assert missing == names("turbo3", 128)
    assert all(r.compiled.startswith("missing") for r in report.rows if not r.ok)


def test_auto_is_not_a_concrete_dtype():
    with pytest.raises(MetraleError):
        required_kernels("auto", 128)
