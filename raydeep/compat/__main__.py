"""``python -m raydeep.compat script.py [args...]``: run an unmodified script (a Hugging Face
Trainer script, an Accelerate one) with ``import deepspeed`` served by raydeep.

Works under torchrun too (``torchrun --nproc_per_node 2 -m raydeep.compat train.py ...``): the
finder is installed before the script, and so before transformers or accelerate, is imported.
"""
from __future__ import annotations

import os
import runpy
import sys

from raydeep.compat import install


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    install()
    sys.argv = list(argv)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("python -m raydeep.compat -m MODULE [args...]")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
