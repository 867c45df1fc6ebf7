"""The validate-kernels command: render the report; exit 1 with the whole missing list.

``--kv-cache-dtype all`` checks every one of the 16 dtypes in one run (one table each) and fails
with every dtype's missing kernels.
"""

from __future__ import annotations

from dataclasses import asdict

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.requirements import missing_message
from metrale_cli.kernels.validate import ValidationReport, validate_kernels
from metrale_cli.kv.dtypes import AUTO, KvCacheDtype
from metrale_cli.output import Output

ALL = "all"


def _dtypes(dtype: KvCacheDtype | str) -> list[KvCacheDtype]:
    """The parsed --kv-cache-dtype: one dtype, or ``all``."""
    if dtype == ALL:
        return list(KvCacheDtype)
    if dtype == AUTO:
        raise MetraleError("validate-kernels needs a concrete --kv-cache-dtype (or 'all'), not 'auto'",
                           hint="e.g. --kv-cache-dtype fp8, or --kv-cache-dtype all for every dtype")
    return [dtype]


def _render(out: Output, report: ValidationReport, head_dim: int) -> None:
    if report.on_gpu:
        where = "GPU: loaded through CuPy, checked against torch references (cached: passed before on this GPU)"
    else:
        where = "no GPU: compiled to sm_90 cubins, symbols checked"
    out.table(f"kernels for kv-cache-dtype {report.dtype} (head_dim {head_dim})",
              ["kernel", "compiled", "symbol", "numeric"],
              [[r.kernel, r.compiled, r.symbol, r.numeric] for r in report.rows],
              caption=f"{where}; {report.total_seconds:.2f} s, cold compile "
                      f"{report.cold_compile_seconds:.2f} s")


def _as_json(report: ValidationReport, head_dim: int) -> dict:
    return {"kv_cache_dtype": report.dtype, "head_dim": head_dim, "on_gpu": report.on_gpu,
            "ok": report.ok, "missing": [r.kernel for r in report.rows if not r.ok],
            "total_seconds": report.total_seconds, "cold_compile_seconds": report.cold_compile_seconds,
            "kernels": [asdict(r) for r in report.rows]}


def run_validate(out: Output, kv_cache_dtype: KvCacheDtype | str, head_dim: int,
                 recheck: bool = False) -> list[ValidationReport]:
    dtypes = _dtypes(kv_cache_dtype)
    reports = []
    for dtype in dtypes:
        with out.progress(f"checking {dtype.value} kernels", bytes_mode=False) as progress:
            reports.append(validate_kernels(dtype, head_dim, progress=lambda _k, i, n: progress(i + 1, n),
                                            recheck=recheck))
        if not out.json_mode:
            _render(out, reports[-1], head_dim)
    if out.json_mode:
        payload = [_as_json(r, head_dim) for r in reports]
        out.json(payload[0] if len(payload) == 1 else payload)
    problems = []
    for dtype, report in zip(dtypes, reports):
        failed = [r.kernel for r in report.rows if not r.ok]
        if failed:
            problems.append(missing_message(dtype, head_dim, failed))
    if problems:
        raise MetraleError("; ".join(problems))
    return reports
