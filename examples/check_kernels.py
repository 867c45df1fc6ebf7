"""A deployment's start-up check: are the kernels of the KV dtypes it will serve all here?

    python examples/check_kernels.py fp8 turbo4 --head-dim 128 && start-my-server

Exits 0 when every kernel of every dtype compiles (on a GPU: loads and matches its torch
reference), else 1 after printing each dtype's whole missing list, so a deploy script fails
before any weight is loaded.
"""

import argparse
import sys

import metrale_cli as metrale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtypes", nargs="+", help="KV-cache dtypes, e.g. bf16 fp8 turbo4")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    failed = 0
    for dtype in args.dtypes:
        try:
            report = metrale.validate_kernels(dtype, args.head_dim)
        except metrale.MetraleError as e:
            print(f"{dtype}: error: {e.message}")
            failed += 1
            continue
        missing = [row.kernel for row in report.rows if not row.ok]
        where = "checked on the GPU" if report.on_gpu else "compiled for sm_90"
        print(f"{report.dtype}: {len(report.rows) - len(missing)}/{len(report.rows)} kernels ok ({where})")
        for name in missing:
            print(f"  missing: {name}")
        failed += bool(missing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
