"""`ray job submit` entrypoint for `raydeep bench` on the cluster's CPU workers:

    ray job submit --runtime-env jobs/runtime_env.yaml -- \
        python jobs/bench.py --model gpt-small-cpu --world 4 --steps 9 --out /mnt/cluster_storage/bench

The job's driver joins the cluster (``RAY_ADDRESS`` is set inside a job) and runs the ranks as Ray
actors (``--ray``, added here), so they land on the workers, not on the head. The table goes to
the job's log (``ray job logs``); ``--out`` should be storage every node can reach.
"""
from __future__ import annotations

import sys

from raydeep.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(["bench", *([] if "--ray" in args else ["--ray"]), *args]))
