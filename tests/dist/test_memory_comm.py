"""ZeRO's promises, measured by the engine itself: per-rank model-state bytes against the ZeRO
formula (fp32: params 4, grads 4, Adam 8 bytes per element, divided by N as the stage says) and
bytes moved per optimizer step against the collective volumes of the ZeRO paper."""
import sys

import pytest
from torch import nn

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, tiny_gpt, train_engine

GAS, MICRO, STEPS = 2, 2, 2


def measure(stage: int) -> dict:
    from raydeep import comm

    result = train_engine(stage_config(stage), STEPS + 1, MICRO * GAS * comm.world_size(), warmup_steps=1)
    result.pop("params")  # not needed here: keep what comes back from each rank small
    return result


def stage_config(stage: int) -> dict:
    cfg = config(stage, GAS, MICRO, 1.0)
    # Exactly two gathers per micro-step: no prefetch, no keeping blocks between forward and backward.
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    return cfg


def model_counts(model: nn.Module, zero: dict) -> dict[str, int]:
    """Elements of the model (``psi``), of its persistent parameters, and of its stage-3 root unit,
    from the model and the config alone (DeepSpeed's rules; the engine under test is not asked).

    Persistent: a parameter of at most ``stage3_param_persistence_threshold`` elements, while the
    persistent parameters so far stay within ``stage3_model_persistence_threshold``. Partition units
    (``partition_units: "auto"``): every element of an ``nn.ModuleList`` (a transformer block) owns
    its parameters; the root unit owns the rest (embeddings, final norm, a tied head), minus the
    persistent ones. The root's forward ends last and its backward starts first: nothing is fetched
    in between, its reuse distance is 0, and it is gathered once per micro-step instead of twice.
    """
    per_param = zero.get("stage3_param_persistence_threshold", 100_000)
    budget = zero.get("stage3_model_persistence_threshold", sys.maxsize)
    in_blocks = {id(p) for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml for p in m.parameters()}
    psi = persistent = root = 0
    for p in model.parameters():  # each parameter once, tied ones included
        psi += p.numel()
        if p.numel() <= per_param and p.numel() <= budget:
            persistent += p.numel()
            budget -= p.numel()
        elif id(p) not in in_blocks:
            root += p.numel()
    return {"psi": psi, "persistent": persistent, "root": root}


def formula(stage: int, psi: int, persistent: int, n: int) -> dict:
    params = 4 * psi if stage < 3 else 4 * ((psi - persistent) / n + persistent)
    grads = 4 * psi if stage < 2 else 4 * psi / n
    states = 8 * psi if stage == 0 else 8 * psi / n
    return {"params": params, "grads": grads, "optimizer_states": states}


def theory_bytes(stage: int, psi: int, persistent: int, root: int) -> dict:
    step = {0: {"all_reduce": 4 * psi},
            1: {"reduce_scatter": 4 * psi, "all_gather": 4 * psi},
            2: {"reduce_scatter": GAS * 4 * psi, "all_gather": 4 * psi},
            3: {"reduce_scatter": GAS * 4 * psi, "all_gather": GAS * 4 * (2 * (psi - persistent) - root) + 4 * persistent}}
    return step[stage]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_and_communication_match_zero_theory(world_size):
    rows = []
    for stage in range(4):
        counts = model_counts(tiny_gpt(), stage_config(stage)["zero_optimization"])
        psi, persistent = counts["psi"], counts["persistent"] if stage == 3 else 0
        results = run_ranks(measure, world_size, stage)
        for res in results:
            assert res["numel"] == psi
            expected = formula(stage, psi, persistent, world_size)
            for kind, want in expected.items():
                got = res["memory"][kind]
                assert abs(got - want) <= 0.005 * want, f"stage {stage} {kind}: {got} vs formula {want:.0f}"
            for op, want in theory_bytes(stage, psi, persistent, counts["root"]).items():
                got = res["comm"][op]["bytes"] / STEPS
                assert abs(got - want) <= 0.02 * want, f"stage {stage} {op}: {got:.0f} B/step vs theory {want:.0f}"
            if stage >= 1:
                assert "broadcast" not in res["comm"] and res["comm"]["all_reduce"]["bytes"] <= 16 * STEPS
        mem = results[0]["memory"]
        rows.append(f"stage {stage}: params {mem['params']} grads {mem['grads']} states {mem['optimizer_states']} "
                    f"comm/step { {k: v['bytes'] // STEPS for k, v in results[0]['comm'].items()} }")
    print(f"\nworld {world_size}, psi {counts['psi']}, persistent {counts['persistent']}, root unit {counts['root']}:"
          "\n  " + "\n  ".join(rows))
