"""The Trainer on raydeep saved on one number of ranks and resumed on another (DeepSpeed refuses:
"The checkpoint being loaded used a DP world size of 2 but the current world size is 1").

Sixteen samples and a global batch of 16 (8 per rank on 2, 16 on 1): every step sees every
sample whatever the number of ranks, so a resumed run must continue with the straight run's
losses. Dropout is off (its random masks depend on the ranks). Rank 0 prints ``LOSSES <json>``:
``[step, loss]`` of each logged step.

    python -m torch.distributed.run --nproc_per_node 2 resume_world_script.py OUT    # straight, saves at 4
    python -m torch.distributed.run --nproc_per_node 1 resume_world_script.py OUT2 OUT/checkpoint-4
"""
from __future__ import annotations

import json
import os
import sys

from workload import backend

backend("raydeep", hide_installed=True)

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import raydeep  # noqa: E402

raydeep.init_distributed()
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # on CPU accelerate makes DeepSpeed's state only when asked
PartialState(backend="gloo")
world = torch.distributed.get_world_size()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
tokens = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
             "zero_optimization": {"stage": 2}}
losses = []


class KeepLosses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses.append([state.global_step, float(logs["loss"])])


args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=16 // world, max_steps=8,
                         learning_rate=1e-3, logging_steps=1, save_steps=4, report_to=[], deepspeed=ds_config,
                         seed=0, data_seed=0, disable_tqdm=True, accelerator_config={"use_configured_state": True})
Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        callbacks=[KeepLosses()]).train(resume_from_checkpoint=sys.argv[2] if len(sys.argv) > 2 else None)
if int(os.environ.get("RANK", 0)) == 0:
    print("LOSSES " + json.dumps(losses), flush=True)
torch.distributed.destroy_process_group()
os._exit(0)  # see trainer_script.py: no teardown races after the group is gone
