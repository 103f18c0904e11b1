"""A training script written the way DeepSpeed's examples write them; only the import differs.

    torchrun --nproc_per_node 2 ds_style_train.py --deepspeed --deepspeed_config ds_config.json \
        --save_dir CKPT --steps 4 [--resume]

It trains until ``engine.global_steps`` reaches ``--steps`` and saves a checkpoint whose client
state records where in the data it stopped (epoch, micro-batches consumed in it), so ``--resume``
continues with the next micro-batch, as an uninterrupted run would.
"""
import argparse
import json
import os
import sys

import torch

import raydeep as deepspeed  # the one changed line: was `import deepspeed`
from raydeep.data import builtin_dataset
from raydeep.models import build_gpt


def parse_args():
    parser = argparse.ArgumentParser(description="GPT on the standard library")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train(engine, loader, steps: int, epoch: int, consumed: int) -> tuple[list[float], int, int]:
    """Train until ``steps`` optimizer steps, starting after ``consumed`` micro-batches of ``epoch``;
    returns the losses and where the data stream stopped (epoch, micro-batches consumed in it)."""
    losses = []
    while engine.global_steps < steps:
        loader.sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if index < consumed:  # trained on before the checkpoint
                continue
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            consumed = index + 1
            if engine.global_steps >= steps:
                break
        else:
            epoch, consumed = epoch + 1, 0
    return losses, epoch, consumed


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = build_gpt("gpt-tiny", n_layer=2, block_size=64)
    dataset = builtin_dataset(block_size=64, max_bytes=200_000)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    epoch, consumed = 0, 0
    if args.resume:
        load_path, client_state = engine.load_checkpoint(args.save_dir)
        assert load_path is not None, "nothing to resume from"
        epoch, consumed = client_state["epoch"], client_state["consumed"]
    engine.train()
    losses, epoch, consumed = train(engine, loader, args.steps, epoch, consumed)
    engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch, "consumed": consumed})
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                                      "lr": engine.get_lr(), "losses": losses, "stage": engine.zero_optimization_stage(),
                                      "micro": engine.train_micro_batch_size_per_gpu(),
                                      "gas": engine.gradient_accumulation_steps(),
                                      "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
                                      "epoch": epoch, "consumed": consumed}))
    engine.destroy()
    torch.distributed.destroy_process_group()
    # About one launch in ten, a rank aborted in the interpreter's own teardown, after all of the
    # above ("terminate called without an active exception"; not reproduced by a plain gloo
    # script). The work is done and flushed: leave without the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
