"""Kill a saving process at a chosen point: ``python -m tests.dist.checkpoint_crash DIR POINT``.

The process trains the tiny GPT in a one-rank group, commits checkpoint ``good`` (2 steps),
trains one more step and starts saving ``doomed`` — then dies with ``os._exit(KILLED)`` (no
cleanup, no flush, like SIGKILL) at ``POINT``:

- ``first-file``: after the first data file of the new tag is written, before the next one;
- ``before-manifest``: every data file written, the manifest not yet;
- ``before-rename``: manifest written into the staging directory, not yet moved into place;
- ``before-latest``: the tag is in place, ``latest`` not yet rewritten.
"""
from __future__ import annotations

import os
import sys

KILLED = 17
POINTS = ("first-file", "before-manifest", "before-rename", "before-latest")


def _die_at(point: str) -> None:
    from raydeep.checkpoint import format as fmt
    from raydeep.storage import Storage

    write, rename, atomic = Storage.write, Storage.rename_dir, Storage.write_atomic

    def patched_write(self, rel, data, **kwargs):
        if point == "before-manifest" and rel.endswith(fmt.MANIFEST):
            os._exit(KILLED)
        write(self, rel, data, **kwargs)
        if point == "first-file" and "doomed" in rel:
            os._exit(KILLED)

    def patched_rename(self, src, dst):
        if point == "before-rename" and dst == "doomed":
            os._exit(KILLED)
        rename(self, src, dst)

    def patched_atomic(self, rel, data):
        if point == "before-latest" and rel == fmt.LATEST:
            os._exit(KILLED)
        atomic(self, rel, data)

    Storage.write, Storage.rename_dir, Storage.write_atomic = patched_write, patched_rename, patched_atomic


def main(directory: str, point: str) -> None:
    import torch.distributed as dist

    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, build
    from tests.dist.workloads import run_steps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("CRASH_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = build(3)
    run_steps(engine, 2, GLOBAL_BATCH)
    engine.save_checkpoint(directory, tag="good")
    run_steps(engine, 3, GLOBAL_BATCH, skip=2)
    _die_at(point)
    engine.save_checkpoint(directory, tag="doomed")
    raise SystemExit(0)  # not reached when the point is hit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
