"""Checkout-local entry point for the converter (same as ``mlx-dflash convert``).

    python convert/convert.py --hf-path SRC --mlx-path DST [-q] [--dtype bfloat16]

Lets a source checkout convert without installing the package; the options
and behaviour are those of ``dflash_mlx.convert`` (see convert/README.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_mlx.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
