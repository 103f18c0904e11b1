"""ZeRO's promises, measured by the engine itself: per-rank model-state bytes against the ZeRO
formula (fp32: params 4, grads 4, Adam 8 bytes per element, divided by N as the stage says) and
bytes moved per optimizer step against the collective volumes of the ZeRO paper."""
import pytest

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, train_engine

GAS, MICRO, STEPS = 2, 2, 2


def measure(stage: int) -> dict:
    from raydeep import comm

    cfg = config(stage, GAS, MICRO, 1.0)
    # Exactly two gathers per micro-step: no prefetch, no keeping blocks between forward and backward.
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    result = train_engine(cfg, STEPS + 1, MICRO * GAS * comm.world_size(), warmup_steps=1)
    import raydeep
    from tests.dist.workloads import tiny_gpt

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    strategy = engine.strategy
    result["persistent"] = sum(u.numel for i, u in enumerate(strategy.units) if i in getattr(strategy, "persistent", ()))
    # The root unit (embeddings, final norm) is used last in forward and first in backward:
    # nothing is fetched in between, so its reuse distance is 0 and it stays gathered.
    result["root"] = sum(strategy.units[i].numel for i in strategy.module_units[0][1]) if stage == 3 else 0
    return result


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
        results = run_ranks(measure, world_size, stage)
        for res in results:
            psi, persistent = res["numel"], res["persistent"]
            expected = formula(stage, psi, persistent, world_size)
            for kind, want in expected.items():
                got = res["memory"][kind]
                assert abs(got - want) <= 0.005 * want, f"stage {stage} {kind}: {got} vs formula {want:.0f}"
            for op, want in theory_bytes(stage, psi, persistent, res["root"]).items():
                got = res["comm"][op]["bytes"] / STEPS
                assert abs(got - want) <= 0.02 * want, f"stage {stage} {op}: {got:.0f} B/step vs theory {want:.0f}"
            if stage >= 1:
                assert "broadcast" not in res["comm"] and res["comm"]["all_reduce"]["bytes"] <= 16 * STEPS
        mem = results[0]["memory"]
        rows.append(f"stage {stage}: params {mem['params']} grads {mem['grads']} states {mem['optimizer_states']} "
                    f"comm/step { {k: v['bytes'] // STEPS for k, v in results[0]['comm'].items()} }")
    print(f"\nworld {world_size}, psi {results[0]['numel']}:\n  " + "\n  ".join(rows))
