"""Every activation-checkpointing policy and option trains exactly as no checkpointing does: on 2
gloo ranks, fp32, dropout on, ZeRO stages 0 and 3, the losses, the global gradient norms and the
parameters after the steps are bitwise equal to a run without the ``activation_checkpointing``
section. Recomputation replays the same random state and the same arithmetic, and moving saved
tensors (to host memory, into contiguous buffers) copies bits, so nothing may differ at all.
"""
import pytest

from tests.dist.harness import run_ranks

STEPS, GAS, MICRO = 2, 2, 2
REPORT = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 12,
          "synchronize_checkpoint_boundary": True, "profile": False}
VARIANTS = {
    "attention": ({}, "attention"),
    "block": ({}, "block"),
    "class list": ({}, ["MLP"]),
    "block + cpu_checkpointing": ({"cpu_checkpointing": True}, "block"),
    "every other block": ({"number_checkpoints": 1}, "block"),
    "block + contiguous": ({"partition_activations": True, "contiguous_memory_optimization": True,
                           "number_checkpoints": 2}, "block"),
    "attention + synchronize + profile": ({"synchronize_checkpoint_boundary": True, "profile": True}, "attention"),
    "report's section": (REPORT, "attention"),
    "offload_activations": (None, "offload"),
}


def _run(stage: int, section, modules) -> dict:
    import torch

    import raydeep
    from raydeep import comm
    from raydeep.models import build_gpt
    from raydeep.zero import GatheredParameters
    from tests.dist.workloads import SEQ, config, run_steps

    extra = {}
    if modules == "offload":
        extra["raydeep"] = {"offload_activations": True}
    elif section is not None:
        extra = {"activation_checkpointing": section, "raydeep": {"checkpoint_modules": modules}}
    torch.manual_seed(0)
    model = build_gpt("gpt-tiny", block_size=SEQ, n_layer=2, n_embd=64, n_head=4, dropout=0.1)
    engine, *_ = raydeep.initialize(model=model, config=config(stage, GAS, MICRO, 1.0, **extra))
    torch.manual_seed(100 + comm.rank())  # each rank its own dropout stream, the same in every run
    norms = []
    losses = []
    for _ in range(STEPS):
        losses += run_steps(engine, 1, MICRO * GAS * comm.world_size())
        norms.append(engine.get_global_grad_norm())
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def parity_runs() -> dict:
    out = {}
    for stage in (0, 3):
        out[(stage, "reference")] = _run(stage, None, None)
        for name, (section, modules) in VARIANTS.items():
            out[(stage, name)] = _run(stage, section, modules)
    return out


@pytest.mark.slow
def test_every_option_is_bitwise_equal_to_no_checkpointing():
    import torch

    for res in run_ranks(parity_runs, 2):
        for (stage, name), run in res.items():
            base = res[(stage, "reference")]
            assert run["losses"] == base["losses"], (stage, name)
            assert run["norms"] == base["norms"], (stage, name)
            for param, value in base["params"].items():
                assert torch.equal(run["params"][param], value), (stage, name, param)
