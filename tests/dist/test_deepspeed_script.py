"""A DeepSpeed-style script (argparse + add_config_arguments + init_distributed +
initialize(args=..., training_data=...) + save/load) runs under torchrun with only its import
changed to ``import raydeep as deepspeed``; a second launch resumes from its checkpoint and ends
exactly where one uninterrupted launch of the same length ends.

Exactly, bit for bit: the resumed run sees the same ranks, the same micro-batches in the same
order and issues the same collectives as the uninterrupted one, and the checkpoint holds the
fp32 masters, Adam's moments and step count, the scheduler and the counters exactly (fp32 in
safetensors). Identical inputs to identical arithmetic give identical bits, so any difference,
however small, means the resume lost or changed some state (a step count that restarts would
change Adam's bias correction; a scheduler that restarts, the learning rate).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raydeep.checkpoint import CheckpointReader
from tests.dist.harness import free_port

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ds_style_train.py")
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 10, "warmup_type": "linear"}},
          "zero_optimization": {"stage": 2}}
FIRST, TOTAL, GAS = 4, 6, 2


def _launch(tmp_path, save_dir: str, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           SCRIPT, "--deepspeed", "--deepspeed_config", str(tmp_path / "ds_config.json"),
           "--save_dir", str(tmp_path / save_dir), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _final_state(directory) -> tuple[dict[str, torch.Tensor], dict]:
    """Every per-element state of the latest checkpoint (masters, Adam's moments) by kind and
    parameter, and the rest of its manifest: counters, scheduler, layout, config.

    Left out: the file list (names and checksums: compared through the tensors instead) and the
    RNG states. Python's and NumPy's generators are not seeded by the script, so any two launches
    differ there, and every new DataLoader iterator draws its seed from torch's generator (the
    resumed launch starts one iterator more). Nothing in this training draws random numbers (no
    dropout), so the weights do not depend on them.
    """
    reader = CheckpointReader.open(str(directory))
    tensors = {f"{kind}/{name}": reader.full(kind, name) for kind in reader.state_kinds for name in reader.params}
    manifest = {k: v for k, v in reader.manifest.items() if k not in ("files", "rng")}
    return tensors, manifest


def test_deepspeed_script_trains_saves_and_resumes(tmp_path):
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    first = _launch(tmp_path, "ckpt", "--steps", str(FIRST))
    assert (first["global_steps"], first["global_samples"]) == (FIRST, FIRST * 16)
    assert (first["stage"], first["micro"], first["gas"], first["fp16"], first["bf16"]) == (2, 4, GAS, False, False)
    assert len(first["losses"]) == FIRST * GAS and all(0 < x < 10 for x in first["losses"])
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{FIRST}"

    resumed = _launch(tmp_path, "ckpt", "--steps", str(TOTAL), "--resume")
    assert (resumed["global_steps"], resumed["global_samples"]) == (TOTAL, TOTAL * 16)
    assert len(resumed["losses"]) == (TOTAL - FIRST) * GAS
    # WarmupLR continued from step 4: after 6 steps lr = max_lr * (6 - 1) / 10 (DeepSpeed's timing)
    assert resumed["lr"] == [pytest.approx(1e-3 * 5 / 10)]
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{TOTAL}"

    straight = _launch(tmp_path, "straight", "--steps", str(TOTAL))
    assert straight["losses"][:FIRST * GAS] == first["losses"], "two identical launches differ: not deterministic"
    assert resumed["losses"] == straight["losses"][FIRST * GAS:], (
        f"losses after the resume {resumed['losses']} differ from the uninterrupted run's "
        f"{straight['losses'][FIRST * GAS:]}")
    assert (resumed["lr"], resumed["epoch"], resumed["consumed"]) == (straight["lr"], straight["epoch"],
                                                                     straight["consumed"])
    ours, manifest = _final_state(tmp_path / "ckpt")
    theirs, straight_manifest = _final_state(tmp_path / "straight")
    assert ours.keys() == theirs.keys() and any(key.startswith("exp_avg/") for key in ours)
    differ = [key for key in ours if not torch.equal(ours[key], theirs[key])]
    assert not differ, (f"{len(differ)} of {len(ours)} final states differ from the uninterrupted run's, e.g. "
                        f"{differ[0]}: max |diff| {(ours[differ[0]] - theirs[differ[0]]).abs().max():.3g}")
    assert manifest == straight_manifest
