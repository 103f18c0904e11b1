"""The Hugging Face Trainer of ``trainer_script.py`` run by Ray Train: a ``TorchTrainer`` with
2 CPU workers, each running the same Trainer function, with ``import deepspeed`` served by
raydeep in every worker through ``runtime_env={"worker_process_setup_hook":
"raydeep.compat.install"}`` (the hook runs when the worker process starts, before the training
function, and so before transformers, is imported there).

    python tests/hf/ray_trainer_script.py --out DIR [trainer_script.py options but --backend]

Prints ``RESULT <json>`` as trainer_script.py does (rank 0's records, written by the worker).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def train_func(config: dict) -> None:
    """One Ray Train worker: Ray has set up the gloo process group and RANK/LOCAL_RANK/WORLD_SIZE;
    the setup hook has installed raydeep.compat."""
    import deepspeed
    import trainer_script
    import workload

    opts = trainer_script.parse(config["argv"])
    workload.deepspeed_state_on_gloo()
    result = {"backend": "raydeep on Ray Train", "trainer": trainer_script.trainer_phases(opts)}
    if opts.also_hf_optimizer:
        variant = argparse.Namespace(**{**vars(opts), "hf_optimizer": True, "out": os.path.join(opts.out, "hf-opt")})
        result["trainer_hf_optimizer"] = trainer_script.trainer_phases(variant)
    if opts.accelerate:
        result["accelerate"] = trainer_script.accelerate_phases(opts)
    if int(os.environ["RANK"]) == 0:
        result.update(deepspeed_file=deepspeed.__file__, deepspeed_modules=workload.deepspeed_files())
        Path(opts.out, "result.json").write_text(json.dumps(result))


def main() -> None:
    import trainer_script

    argv = ["--backend", "raydeep", *sys.argv[1:]]
    opts = trainer_script.parse(argv)
    argv += ["--out", os.path.abspath(opts.out)]

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    path = [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]  # this folder's modules, raydeep
    env = {"PYTHONPATH": os.pathsep.join(path).rstrip(os.pathsep),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ray.init(address="local", num_cpus=2, log_to_driver=False, logging_level="ERROR",
             runtime_env={"worker_process_setup_hook": "raydeep.compat.install", "env_vars": env})
    try:
        with tempfile.TemporaryDirectory() as storage:
            TorchTrainer(train_func, train_loop_config={"argv": argv}, torch_config=TorchConfig(backend="gloo"),
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                      resources_per_worker={"CPU": 1}),
                         run_config=RunConfig(storage_path=storage, name="hf-trainer")).fit()
    finally:
        ray.shutdown()
    print("RESULT " + Path(opts.out, "result.json").read_text(), flush=True)


if __name__ == "__main__":
    main()
