"""Checkpoints crossing engines: a DeepSpeed checkpoint imported with ``raydeep convert
import-deepspeed`` continues training in raydeep exactly as DeepSpeed continues it, and
consolidated weights exported with ``raydeep convert export`` load into a new run at any stage.

Two gloo ranks, global batch 12 (micro 3 x GAS 2 x 2 ranks), AdamW (``torch_adam``), WarmupDecayLR,
clipping 1.0. DeepSpeed trains 3 steps, ``save_checkpoint``s and trains 3 more; the import is
loaded into a raydeep engine of the same stage and config, which trains the same 3 steps. The
per-step losses and the final parameters must agree within 1e-5, and the restored counters,
learning rate and client state must be DeepSpeed's.

- fp32 at stages 1, 2 and 3 on the tiny GPT. A control run loads the same import without its
  optimizer state: its losses must differ by far more than the tolerance, so the comparison does
  see the Adam moments and step count.
- bf16 on a GPT of odd width (33, so parameters have odd sizes and DeepSpeed pads): ZeRO-1 with
  fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``, a layout ``zero_to_fp32`` rejects),
  ZeRO-2 with ``parameter_alignment`` (padding between parameters and at the tail of the last
  rank), and ZeRO-3 (per-parameter padding).

fp16 cannot run on DeepSpeed's CPU accelerator; its files have the fp32/bf16 layout plus a loss
scaler object, which tests/unit/test_convert.py covers with synthetic files.

Export: a raydeep run saves at ZeRO-2, rank 0 exports ``model.safetensors``, and fresh engines at
stages 0-3 (and bf16 at stage 3) ``load_into_engine`` it: their gathered parameters equal the file
bit for bit, and their training steps equal those of an engine that loaded the checkpoint
itself with ``load_module_only=True`` (two steps, so the fp32 masters matter too).
"""
from __future__ import annotations

import os

import pytest

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow
peers = pytest.mark.peers

BEFORE, AFTER, TOL = 3, 3, 1e-5
BF16 = {"bf16": {"enabled": True}}
ZERO2_ALIGNED = {"stage": 2, "reduce_bucket_size": 20000, "parameter_alignment": True}
# (ZeRO stage, extra config, model width, run the control)
FP32_CASES = [(stage, {}, 64, True) for stage in (1, 2, 3)]
BF16_CASES = [(1, {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}, 33, False),
              (2, {**BF16, "zero_optimization": ZERO2_ALIGNED}, 33, False),
              (3, BF16, 33, False)]
BF16_LABELS = ["bf16 ZeRO-1 (BF16_Optimizer)", "bf16 ZeRO-2 parameter_alignment", "bf16 ZeRO-3"]


def _diffs(deepspeed: dict, raydeep: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(deepspeed["losses"], raydeep["losses"]))
    param = max((deepspeed["params"][n] - raydeep["params"][n]).abs().max().item() for n in raydeep["params"])
    return loss, param


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    """Every case in one process group: DeepSpeed's import and start-up are paid once."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", exc_type=ImportError)
    from tests.dist.deepspeed_peer import deepspeed_import_continuation

    directory = str(tmp_path_factory.mktemp("deepspeed_import"))
    return run_ranks(deepspeed_import_continuation, 2, directory, FP32_CASES + BF16_CASES, BEFORE, AFTER)[0]


def _check(label: str, result: dict) -> tuple[float, float]:
    deepspeed, raydeep = result["deepspeed"], result["raydeep"]
    assert result["status"] == 0
    assert result["client"]["note"] == "from deepspeed"
    assert raydeep["steps"] == deepspeed["steps"] == BEFORE + AFTER
    assert raydeep["lr"] == pytest.approx(deepspeed["lr"], rel=1e-12)
    loss, param = _diffs(deepspeed, raydeep)
    print(f"{label}: max |loss diff| {loss:.3e}, max |param diff| {param:.3e}; "
          f"DeepSpeed {[round(x, 6) for x in deepspeed['losses']]}")
    assert loss <= TOL and param <= TOL, (label, loss, param)
    return loss, param


@peers
def test_fp32_stages_continue_like_deepspeed(continued, capsys):
    with capsys.disabled():
        for i, (stage, *_) in enumerate(FP32_CASES):
            _check(f"fp32 ZeRO-{stage}", continued[i])
            control_loss, _ = _diffs(continued[i]["deepspeed"], continued[i]["weights_only"])
            print(f"  control without optimizer state: max |loss diff| {control_loss:.3e}")
            assert control_loss > 100 * TOL


@peers
def test_bf16_padded_layouts_continue_like_deepspeed(continued, capsys):
    with capsys.disabled():
        for i, label in enumerate(BF16_LABELS):
            _check(f"{label}, width 33", continued[len(FP32_CASES) + i])


# --- exported weights into a new run ---------------------------------------------------------------
def export_and_load(directory: str, cases: list[tuple[int, dict]]) -> dict:
    """Runs on every rank: save a ZeRO-2 run, export it (rank 0), then per (stage, extra config)
    load the export into a fresh engine; returns the gathered parameters and two steps' losses
    (the second depends on the fp32 masters the load wrote), and the same steps after
    ``load_checkpoint(load_module_only=True)`` as the control."""
    import torch.distributed as dist

    from raydeep.checkpoint.convert import main as convert
    from raydeep.checkpoint.export import load_into_engine
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, build, full_params
    from tests.dist.workloads import run_steps

    engine = build(2)
    run_steps(engine, 3, GLOBAL_BATCH)
    engine.save_checkpoint(f"{directory}/run")
    status = convert(["export", f"{directory}/run", f"{directory}/export"]) if dist.get_rank() == 0 else 0
    dist.barrier()
    out = {"status": status}
    for stage, extra in cases:
        engine = build(stage, **extra)
        unused = load_into_engine(engine, f"{directory}/export")
        params = full_params(engine)
        losses = run_steps(engine, 2, GLOBAL_BATCH)
        control = build(stage, **extra)
        control.load_checkpoint(f"{directory}/run", load_module_only=True)
        out[(stage, bool(extra))] = {"params": params, "losses": losses, "unused": unused,
                                     "control": run_steps(control, 2, GLOBAL_BATCH)}
    return out


def test_exported_weights_load_at_any_stage(tmp_path):
    import torch

    from raydeep.checkpoint.export import load_consolidated

    cases = [(0, {}), (1, {}), (2, {}), (3, {}), (3, BF16)]
    results = run_ranks(export_and_load, 2, str(tmp_path), cases)[0]
    assert results.pop("status") == 0
    exported = load_consolidated(str(tmp_path / "export" / "model.safetensors"))
    for (stage, bf16), got in results.items():
        dtype = torch.bfloat16 if bf16 else torch.float32
        assert got["params"].keys() == exported.keys() and got["unused"] == []
        for name, weight in exported.items():
            assert torch.equal(got["params"][name], weight.to(dtype).float()), (stage, bf16, name)
        assert got["losses"] == got["control"], (stage, bf16)
