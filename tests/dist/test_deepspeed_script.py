"""A DeepSpeed-style script (argparse + add_config_arguments + init_distributed +
initialize(args=..., training_data=...) + save/load) runs under torchrun with only its import
changed to ``import raydeep as deepspeed``; a second launch resumes from its checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist.harness import free_port

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ds_style_train.py")
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 10, "warmup_type": "linear"}},
          "zero_optimization": {"stage": 2}}


def _launch(tmp_path, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           SCRIPT, "--deepspeed", "--deepspeed_config", str(tmp_path / "ds_config.json"),
           "--save_dir", str(tmp_path / "ckpt"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_deepspeed_script_trains_saves_and_resumes(tmp_path):
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    first = _launch(tmp_path, "--steps", "4")
    assert (first["global_steps"], first["global_samples"]) == (4, 4 * 16)
    assert (first["stage"], first["micro"], first["gas"], first["fp16"], first["bf16"]) == (2, 4, 2, False, False)
    assert len(first["losses"]) == 8 and all(0 < x < 10 for x in first["losses"])
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"

    second = _launch(tmp_path, "--steps", "6", "--resume")
    assert (second["global_steps"], second["global_samples"]) == (6, 6 * 16)
    assert len(second["losses"]) == 4  # two more optimizer steps, two micro-batches each
    # WarmupLR continued from step 4: after 6 steps lr = max_lr * (6 - 1) / 10 (DeepSpeed's timing)
    assert second["lr"] == [pytest.approx(1e-3 * 5 / 10)]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step6"
