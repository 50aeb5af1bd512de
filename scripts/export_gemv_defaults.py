"""Ship the GEMV tuning's choices for a GPU: copy them from a tuning cache folder (what a start
on that GPU wrote, `--tuning-cache-dir`) into `tokenmill/assets/gemv_defaults/<GPU>.json`,
merged with what is shipped for it already. A later first start on that GPU checks those
choices against cuBLAS instead of building and timing every candidate (see
`tokenmill.kernels.gemv_tuning.ShippedChoices`).

    python scripts/export_gemv_defaults.py ~/.cache/tokenmill/tuning [--output DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.kernels.gemv_tuning import SHIPPED_DIR, export_shipped_choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tuning_dir", type=Path, help="a tuning cache folder (a folder per GPU)")
    parser.add_argument(
        "--output", type=Path, default=SHIPPED_DIR, help=f"where to write (default {SHIPPED_DIR})"
    )
    args = parser.parse_args()
    for path in export_shipped_choices(args.tuning_dir, args.output):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
