"""``raydeep autotune`` end to end on a local Ray cluster: three candidates of the tiny GPT, one
pruned by the memory budget, one failing with an out-of-memory error, one finishing; the table,
the statuses, the best config and no placement group left behind."""
from __future__ import annotations

import json

import pytest
import ray

from raydeep.cli import main
from raydeep.config import load_config

pytestmark = pytest.mark.slow

OOM_ABOVE = 4  # oom_gpt's forward runs out of "memory" above this many samples per micro batch


def oom_gpt():
    """``--model tests.ray.test_autotune:oom_gpt``: gpt-tiny whose forward raises the CUDA
    allocator's ``torch.OutOfMemoryError`` on a micro batch above :data:`OOM_ABOVE`: a device
    too small for the larger micro batches, deterministically, on a CPU."""
    import torch

    from raydeep.models import build_gpt

    model = build_gpt("gpt-tiny")
    plain_forward = model.forward

    def forward(x, *args, **kwargs):
        if x.shape[0] > OOM_ABOVE:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a micro batch of {x.shape[0]}")
        return plain_forward(x, *args, **kwargs)

    model.forward = forward
    return model


def this_jobs_placement_groups() -> list:
    """Placement groups this driver's job (its Tune trials, their Train runs) created and did not remove."""
    from ray.util.state import list_placement_groups

    context = ray.get_runtime_context()
    groups = list_placement_groups(address=context.gcs_address, detail=True,
                                   filters=[("creator_job_id", "=", context.get_job_id())])
    return [pg for pg in groups if pg.state != "REMOVED"]


def test_autotune_prunes_fails_and_writes_the_best(connected, tmp_path, capsys):
    """On the package's shared cluster (tests/ray/conftest.py), which holds both trials at once."""
    config = tmp_path / "ds.json"
    # World size 1, global batch 16, micro 4: the grid's first three are micro 4 (the config
    # itself), 16 (above the budget: pruned) and 8 (runs, and oom_gpt fails it).
    config.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                                  "zero_optimization": {"stage": 3}}))
    code = main(["autotune", str(config), "--model", "tests.ray.test_autotune:oom_gpt", "--num-workers", "1",
                 "--steps", "4", "--max-candidates", "3", "--memory-budget", "80MB",
                 "--storage-path", str(tmp_path / "runs"), "--name", "at"])
    left = this_jobs_placement_groups()
    out, err = capsys.readouterr()
    print(out, err, sep="\n")
    assert code == 0
    assert not left, left
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1].isdigit()}
    assert "finished" in rows["0*"] and "4 x 4" in rows["0*"]
    assert "pruned" in rows["1"] and "16 x 1" in rows["1"] and "> budget 80.0 MB" in rows["1"]
    assert "failed" in rows["2"] and "OutOfMemoryError" in rows["2"]
    best = tmp_path / "runs" / "at" / "best_ds_config.json"
    assert f"wrote {best}" in out
    cfg = load_config(str(best), world_size=1)
    zero = cfg.zero_optimization
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, zero.stage) == (4, 4, 3)
    results = json.loads((tmp_path / "runs" / "at" / "autotune.json").read_text())
    assert [r["status"] for r in results] == ["finished", "pruned", "failed"]
