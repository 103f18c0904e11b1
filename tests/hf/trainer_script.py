"""Hugging Face training on DeepSpeed's API, launched under torchrun
(``python -m torch.distributed.run --nproc_per_node 2``) on gloo: the ``Trainer`` with
``TrainingArguments(deepspeed=<ds_config>)`` and, with ``--accelerate``, Accelerate's own
DeepSpeed path (``accelerate_loop.py``).

``--backend deepspeed`` trains on the installed DeepSpeed; ``--backend raydeep`` first calls
``raydeep.compat.install()``, so the same ``import deepspeed`` inside transformers and
accelerate reaches raydeep. Everything else is identical (``workload.py``).

Phases, in one launch (the process start, two ranks importing torch and transformers, is most
of the cost), for the Trainer and then for accelerate:

1. ``straight``: ``--steps`` optimizer steps from scratch, saving at ``--save-at``;
2. ``resumed``: a new model and engine resume from that save and run to ``--steps``; their
   losses must equal the straight run's from ``--save-at`` on.

``--also-hf-optimizer`` adds the Trainer once more without an optimizer in the ds_config: the
Trainer's AdamW (two parameter groups) goes to ``initialize`` as a client optimizer, and the
Trainer makes and steps its scheduler itself.

Rank 0 prints one line ``RESULT <json>``: per phase, the loss (and for the Trainer the learning
rate and gradient norm) of every step, and the file of every ``deepspeed`` module loaded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from workload import TokenData, backend, deepspeed_files, deepspeed_state_on_gloo, tiny_gpt2


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("deepspeed", "raydeep"), required=True)
    parser.add_argument("--out", required=True, help="the runs' output folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=10)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--ds-scheduler", action="store_true",
                        help="Trainer: DeepSpeed's WarmupDecayLR in the ds_config instead of the Trainer's scheduler")
    parser.add_argument("--offload", action="store_true", help="ZeRO-Offload: the optimizer on the CPU")
    parser.add_argument("--hf-optimizer", action="store_true",
                        help="Trainer: no optimizer in the ds_config (the Trainer's AdamW; under --offload accelerate "
                             "swaps it for DeepSpeedCPUAdam)")
    parser.add_argument("--also-hf-optimizer", action="store_true",
                        help="also run the Trainer with --hf-optimizer (result key trainer_hf_optimizer)")
    parser.add_argument("--accelerate", action="store_true", help="also run Accelerate's DeepSpeed path")
    parser.add_argument("--hide-installed-deepspeed", action="store_true",
                        help="raydeep: make an installed DeepSpeed unimportable first (one venv holding both)")
    return parser.parse_args(argv)


def ds_config(stage: int, ds_scheduler: bool, offload: bool = False, hf_optimizer: bool = False) -> dict:
    """A ds_config as Hugging Face's examples write it: the Trainer fills every ``"auto"``."""
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto"},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if hf_optimizer:
        del config["optimizer"]
    if ds_scheduler:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    return config


def train(opts, output_dir: str, resume_from: str | None = None) -> list[dict]:
    """One Trainer run; returns the per-step records it logged (rank 0's; every rank's are the
    same: the Trainer averages the loss over the ranks before it logs)."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    # The process state stays (deepspeed_state_on_gloo); a previous Trainer's DeepSpeed plugin goes.
    AcceleratorState._reset_state(reset_partial_state=False)
    world = int(os.environ.get("WORLD_SIZE", 1))
    config = ds_config(opts.stage, opts.ds_scheduler, opts.offload, opts.hf_optimizer)
    args = TrainingArguments(
        output_dir=output_dir, deepspeed=config, max_steps=opts.steps,
        per_device_train_batch_size=opts.micro, gradient_accumulation_steps=opts.gas, learning_rate=3e-3,
        weight_decay=0.01, warmup_steps=3, max_grad_norm=1.0, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="steps", save_steps=opts.save_at, report_to=[], seed=0,
        accelerator_config={"use_configured_state": True}, dataloader_num_workers=0, disable_tqdm=True,
        log_level="warning", log_level_replica="error")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(opts.steps * opts.micro * opts.gas * world))
    trainer.train(resume_from_checkpoint=resume_from)
    return [{"step": r["step"], "loss": r["loss"], "lr": r["learning_rate"], "grad_norm": r.get("grad_norm")}
            for r in trainer.state.log_history if "loss" in r]


def trainer_phases(opts) -> dict:
    straight = train(opts, os.path.join(opts.out, "straight"))
    checkpoint = os.path.join(opts.out, "straight", f"checkpoint-{opts.save_at}")
    # The resumed Trainer's log starts with the checkpoint's history: keep the steps it trained.
    resumed = [r for r in train(opts, os.path.join(opts.out, "resumed"), resume_from=checkpoint)
               if r["step"] > opts.save_at]
    return {"straight": straight, "resumed": resumed}


def accelerate_phases(opts) -> dict:
    import accelerate_loop

    state = os.path.join(opts.out, "accelerate-state")
    return {"straight": accelerate_loop.train(opts, 1, save_to=state),
            "resumed": accelerate_loop.train(opts, opts.save_at + 1, load_from=state)}


def main() -> None:
    opts = parse()
    deepspeed = backend(opts.backend, opts.hide_installed_deepspeed)
    deepspeed_state_on_gloo()
    result = {"backend": opts.backend, "trainer": trainer_phases(opts)}
    if opts.also_hf_optimizer:
        variant = argparse.Namespace(**{**vars(opts), "hf_optimizer": True, "out": os.path.join(opts.out, "hf-opt")})
        result["trainer_hf_optimizer"] = trainer_phases(variant)
    if opts.accelerate:
        result["accelerate"] = accelerate_phases(opts)
    if int(os.environ.get("RANK", 0)) == 0:
        result.update(deepspeed_file=deepspeed.__file__, deepspeed_modules=deepspeed_files())
        print("RESULT " + json.dumps(result), flush=True)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    # Some launches abort in the interpreter's teardown after all of the above ("terminate called
    # without an active exception"), as tests/dist/scripts/ds_style_train.py records: the work is
    # done and flushed, so leave without the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
