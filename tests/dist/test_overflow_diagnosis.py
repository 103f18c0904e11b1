"""A persistent fp16 overflow in one parameter's gradient (injected on rank 1 only): after
``raydeep.overflow_diagnosis_after`` skipped steps the engine names that parameter, the loss-scale
history and the fix; at the minimum scale DeepSpeed's exception carries the same diagnosis."""
from __future__ import annotations

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, tiny_gpt

POISONED = "blocks.1.mlp.c_fc.weight"
FP16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}


def _overflowing_run(stage: int, steps: int) -> dict:
    import logging

    import torch
    import torch.distributed as dist

    import raydeep

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("raydeep").addHandler(handler)
    model = tiny_gpt()
    if dist.get_rank() == 1:
        dict(model.named_parameters())[POISONED].register_hook(lambda g: torch.full_like(g, float("inf")))
    cfg = config(stage, 1, 2, 1.0, fp16=FP16, raydeep={"overflow_diagnosis_after": 3})
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    error = None
    try:
        for _ in range(steps):
            x = torch.randint(0, 256, (2, 33))
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
    except Exception as err:  # noqa: BLE001 - the test inspects it
        error = (type(err).__name__, str(err))
    finally:
        logging.getLogger("raydeep").removeHandler(handler)
    return {"warnings": [r for r in records if "loss scale collapse" in r], "error": error,
            "skipped": engine.skipped_steps}


def test_persistent_overflow_is_named_and_the_collapse_says_where():
    # Scale 16 with hysteresis 1: steps 1-4 halve it to 1 (the minimum), step 5 raises.
    ranks = run_ranks(_overflowing_run, 2, 2, 8)
    named = [r for r in ranks if any(POISONED in w for w in r["warnings"])]
    assert named, [r["warnings"] for r in ranks]
    for r in ranks:
        assert len(r["warnings"]) == 1 and "3 consecutive steps skipped" in r["warnings"][0]
        assert "loss scale over the last 3 steps: 16 -> 8 -> 4" in r["warnings"][0]
        name, message = r["error"]
        assert name == "LossScaleCollapse"
        assert message.startswith("Current loss scale already at minimum - cannot decrease scale anymore.")
        assert "5 consecutive steps skipped" in message and "bf16" in message
    assert all(POISONED in r["error"][1] for r in ranks)
    assert len({r["error"][1] for r in ranks}) == 1  # every rank tells the same story
    print("\n" + named[0]["error"][1])


def test_clean_fp16_run_says_nothing():
    ranks = run_ranks(_clean_run, 2, 1, 4)
    assert all(r["warnings"] == [] and r["error"] is None for r in ranks)


def _clean_run(stage: int, steps: int) -> dict:
    import logging

    import torch

    import raydeep

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("raydeep").addHandler(handler)
    cfg = config(stage, 1, 2, 1.0, fp16=FP16, raydeep={"overflow_diagnosis_after": 1})
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    try:
        for _ in range(steps):
            x = torch.randint(0, 256, (2, 33))
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
    finally:
        logging.getLogger("raydeep").removeHandler(handler)
    return {"warnings": [r for r in records if "loss scale collapse" in r], "error": None}
