"""The validate-kernels command: render the report; exit 1 with the whole missing list."""

from __future__ import annotations

from dataclasses import asdict

from metrale_cli.errors import MetraleError
from metrale_cli.kernels.validate import validate_kernels
from metrale_cli.kv.dtypes import AUTO, is_experimental, parse_kv_cache_dtype
from metrale_cli.output import Output


def run_validate(out: Output, kv_cache_dtype: str, head_dim: int):
    dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if dtype == AUTO:
        raise MetraleError("validate-kernels needs a concrete --kv-cache-dtype, not 'auto'")
    with out.progress("checking kernels", bytes_mode=False) as progress:
        report = validate_kernels(dtype, head_dim, progress=lambda _k, i, n: progress(i + 1, n))
    failed = [r.kernel for r in report.rows if not r.ok]
    if out.json_mode:
        out.json({"kv_cache_dtype": report.dtype, "head_dim": head_dim, "on_gpu": report.on_gpu,
                  "ok": report.ok, "missing": failed, "total_seconds": report.total_seconds,
                  "cold_compile_seconds": report.cold_compile_seconds,
                  "kernels": [asdict(r) for r in report.rows]})
    else:
        where = "GPU: loaded through CuPy, checked against torch references" if report.on_gpu else \
            "no GPU: compiled to sm_90 cubins, symbols checked"
        out.table(f"kernels for kv-cache-dtype {report.dtype} (head_dim {head_dim})",
                  ["kernel", "compiled", "symbol", "numeric"],
                  [[r.kernel, r.compiled, r.symbol, r.numeric] for r in report.rows],
                  caption=f"{where}; {report.total_seconds:.2f} s, cold compile "
                          f"{report.cold_compile_seconds:.2f} s")
    if failed:
        note = f" ({report.dtype} is experimental)" if is_experimental(dtype) else ""
        raise MetraleError(f"kv-cache-dtype {report.dtype} (head_dim {head_dim}) requires kernel(s) "
                           f"missing from this build: {', '.join(failed)}{note}")
    return report
