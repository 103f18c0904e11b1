"""``engine.save_16bit_model`` at stage 3 on 2 ranks: every rank joins the gathers, rank 0 alone
writes, and what it writes is the whole model in its 16-bit dtype, equal to the fp32 masters
rounded (the module's bf16 weights are exactly that rounding). Between gathers a stage-3
parameter's storage is released, so a save that did not gather would read nothing.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow


def _save_on_ranks(out: str) -> dict:
    import torch.distributed as dist

    import raydeep
    from raydeep.ray.weights import consolidated_fp32
    from tests.dist.workloads import config, run_steps, tiny_gpt

    cfg = config(3, 1, 2, 1.0, bf16={"enabled": True})
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    run_steps(engine, 2, 2 * dist.get_world_size())
    # bytes each parameter's storage holds between gathers (raydeep releases a unit's flat buffer)
    placeholders = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    saved = engine.save_16bit_model(out)
    masters = consolidated_fp32(engine)
    return {"saved": saved, "consolidated_none": consolidated is None, "masters": masters,
            "placeholders": placeholders}


def test_rank_0_writes_the_gathered_16bit_model(tmp_path):
    results = run_ranks(_save_on_ranks, 2, str(tmp_path))
    assert [r["saved"] for r in results] == [True, True]
    assert [r["consolidated_none"] for r in results] == [False, True]  # rank 0's dict, None elsewhere
    masters = results[0]["masters"]
    assert any(held < 2 * masters[name].numel() for name, held in results[0]["placeholders"].items()), \
        "no parameter was partitioned: this test would not see a save that skips the gather"
    saved = torch.load(tmp_path / "pytorch_model.bin")
    names = [n for n in saved if n in masters]
    assert sorted(names) == sorted(masters)
    for name in names:
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], masters[name].to(torch.bfloat16)), name
