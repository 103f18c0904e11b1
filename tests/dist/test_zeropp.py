"""ZeRO++ on 4 gloo ranks declared as 2 nodes x 2 (``LOCAL_WORLD_SIZE=2``): hpZ is exact and keeps
backward's all-gather inside the node; qwZ and qgZ cut the cross-node bytes to their targets;
the bytes are counted per pair of nodes by :class:`tests.dist.zeropp_workloads.NodeBytes`."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.zeropp_workloads import summed, train_counting, zeropp_config

WORLD = 4
STEPS = 3


@pytest.fixture(autouse=True)
def two_nodes_of_two(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")


_RUNS: dict[tuple, list[dict]] = {}  # the same run serves several tests: the suite's time is counted


def _run(precision: str, **zero) -> list[dict]:
    key = (precision, tuple(sorted(zero.items())))
    if key not in _RUNS:
        # stage3_max_reuse_distance 0: no block stays gathered from its forward to its backward, as
        # at scale, where the distance exceeds the default (the tiny model would keep them all)
        cfg = zeropp_config(precision, stage3_max_reuse_distance=0, **zero)
        _RUNS[key] = run_ranks(train_counting, WORLD, cfg, STEPS)
    return _RUNS[key]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hpz_is_zero3_bit_for_bit_and_backward_gathers_stay_in_the_node(precision):
    zero3, hpz = _run(precision), _run(precision, zero_hpz_partition_size=2)
    assert hpz[0]["losses"] == zero3[0]["losses"]
    for name, value in zero3[0]["params"].items():
        assert torch.equal(hpz[0]["params"][name], value), name
    plain, hier = summed(zero3, "cross"), summed(hpz, "cross")
    print(f"\n{precision} cross-node bytes per step, ZeRO-3: {plain}\n{precision} hpZ: {hier}")
    assert plain["backward/all_gather"] > 0
    assert hier.get("backward/all_gather", 0) == 0
    # one primary gather per unit and step: the forward of the step's second micro-batch reads the
    # secondary too (the shards change only at the step), where ZeRO-3 gathers every unit twice
    # per micro-batch (less the root unit, kept from its forward to its backward)
    gathered = lambda t: t.get("forward/all_gather", 0) + t.get("backward/all_gather", 0)  # noqa: E731
    assert gathered(hier) < gathered(plain) / 3
    assert summed(hpz, "intra")["backward/all_gather"] > 0
    # the secondary partition costs 1/2 of the gathered units' bytes on each rank
    assert hpz[0]["memory"]["params"] > zero3[0]["memory"]["params"]


@pytest.mark.peers
def test_hpz_matches_deepspeeds_hpz_on_gloo(capsys):
    """DeepSpeed 0.19.8's hpZ needs no kernel and runs on gloo: the same config, 4 ranks."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", exc_type=ImportError)
    from tests.dist.deepspeed_peer import train_deepspeed
    from tests.dist.workloads import train_engine

    cfg = zeropp_config("fp32", zero_hpz_partition_size=2)
    theirs = run_ranks(train_deepspeed, WORLD, cfg, STEPS, 16, fresh=True)
    ours = run_ranks(train_engine, WORLD, cfg, STEPS, 16)
    loss_diff = max(abs(a - b) for a, b in zip(ours[0]["losses"], theirs[0]["losses"]))
    param_diff = max((ours[0]["params"][n] - p).abs().max().item() for n, p in theirs[0]["params"].items())
    with capsys.disabled():
        print(f"\nhpZ, raydeep vs DeepSpeed (world 4 as 2 x 2, GAS 2, {STEPS} steps): max loss diff "
              f"{loss_diff:.2e}, max param diff {param_diff:.2e}")
    assert loss_diff <= 1e-5 and param_diff <= 1e-5  # the tolerance of test_deepspeed_parity


def test_qwz_gathers_int8_weights_and_keeps_exact_masters(capsys):
    zero3, qwz = _run("bf16"), _run("bf16", zero_quantized_weights=True)
    plain, quant = summed(zero3, "cross"), summed(qwz, "cross")
    gathered = lambda t: t.get("forward/all_gather", 0) + t.get("backward/all_gather", 0)  # noqa: E731
    ratio = gathered(quant) / gathered(plain)
    with capsys.disabled():
        print(f"\nqwZ (bf16): cross-node all-gather bytes per step {gathered(quant):.0f} vs ZeRO-3's "
              f"{gathered(plain):.0f}: {ratio:.4f}x; losses {qwz[0]['losses']} vs {zero3[0]['losses']}")
    # 1 byte per element for 2, plus one fp32 scale per group of up to 8000 elements
    assert 0.5 < ratio <= 0.55
    assert quant["backward/reduce_scatter"] == plain["backward/reduce_scatter"]
    # the quantized weights change the loss a little, not the training
    assert all(abs(a - b) < 0.02 for a, b in zip(qwz[0]["losses"], zero3[0]["losses"]))
    assert qwz[0]["losses"] != zero3[0]["losses"]


def test_qgz_reduce_scatters_int4_across_nodes(capsys):
    zero3, qgz = _run("bf16"), _run("bf16", zero_quantized_gradients=True)
    plain, quant = summed(zero3, "cross"), summed(qgz, "cross")
    reduced = lambda t: t.get("backward/reduce_scatter", 0) + t.get("step/reduce_scatter", 0)  # noqa: E731
    ratio = reduced(quant) / reduced(plain)
    with capsys.disabled():
        print(f"\nqgZ (bf16): cross-node reduce-scatter bytes per step {reduced(quant):.0f} vs ZeRO-3's "
              f"{reduced(plain):.0f}: {ratio:.4f}x; losses {qgz[0]['losses']} vs {zero3[0]['losses']}; "
              f"intra-node {summed(qgz, 'intra')}")
    assert ratio <= 0.30
    assert all(abs(a - b) < 0.05 for a, b in zip(qgz[0]["losses"], zero3[0]["losses"]))


ALL_THREE = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def test_all_three_cut_the_cross_node_bytes_below_three_tenths(capsys):
    zero3, plus = _run("bf16"), _run("bf16", **ALL_THREE)
    plain, both = summed(zero3, "cross"), summed(plus, "cross")
    moved = lambda t: sum(n for key, n in t.items() if not key.startswith("step/"))  # noqa: E731
    ratio = moved(both) / moved(plain)
    with capsys.disabled():
        print(f"\nhpZ + qwZ + qgZ (bf16): cross-node bytes per step {moved(both):.0f} vs ZeRO-3's {moved(plain):.0f}: "
              f"{ratio:.4f}x ({both} vs {plain})")
    assert ratio <= 0.30
    assert both.get("backward/all_gather", 0) == 0


@pytest.mark.parametrize("case", ["ZeRO-3", "hpZ", "qwZ", "qgZ", "all three"])
def test_the_doctor_predicts_every_collective_and_its_bytes(case):
    """The doctor's traffic model (what its time model multiplies by a latency and divides by a
    bandwidth) against the engine's own count, on the runs above."""
    from raydeep.config import load_config
    from raydeep.doctor.shape import ModelShape
    from raydeep.doctor.traffic import predict_traffic
    from tests.dist.workloads import SEQ, tiny_gpt

    zero = {"ZeRO-3": {}, "hpZ": {"zero_hpz_partition_size": 2}, "qwZ": {"zero_quantized_weights": True},
            "qgZ": {"zero_quantized_gradients": True}, "all three": ALL_THREE}[case]
    counted = _run("bf16", **zero)[0]["ops"]
    cfg = load_config(zeropp_config("bf16", stage3_max_reuse_distance=0, **zero), world_size=WORLD)
    traffic = predict_traffic(cfg, ModelShape.from_module(tiny_gpt(), SEQ), gpus_per_node=2)
    print(f"\n{case}: predicted {traffic.calls_by_op} {traffic.by_op}\n counted {counted}")
    assert traffic.calls_by_op == {op: c["calls"] for op, c in counted.items()}
    for op, c in counted.items():  # scalars (the gradient norm) are launches, not bytes
        if c["bytes"] > 1000:
            # the unit's padding to the world and a root unit grouped as a block are not modelled
            assert traffic.by_op[op] == pytest.approx(c["bytes"], rel=0.01), op


@pytest.mark.slow
def test_zero_plus_plus_converges_like_zero3_on_the_builtin_corpus(capsys):
    from tests.dist.zeropp_workloads import train_corpus

    steps = 150  # the loss falls from 5.36 to about 2.47: the gap is what 300 steps show (0.1%), at half the time
    cfg = lambda **zero: zeropp_config("bf16", gas=1, **zero)  # noqa: E731
    zero3 = run_ranks(train_corpus, WORLD, cfg(), steps)[0]
    plus = run_ranks(train_corpus, WORLD, cfg(**ALL_THREE), steps)[0]
    last = lambda losses: sum(losses[-20:]) / 20  # noqa: E731  the last 20 steps: one batch is noisy
    gap = last(plus) / last(zero3) - 1
    with capsys.disabled():
        print(f"\nbuilt-in corpus, world 4 (2 x 2), {steps} steps, bf16: ZeRO-3 {zero3[0]:.4f} -> {last(zero3):.4f}, "
              f"ZeRO++ (all three) {plus[0]:.4f} -> {last(plus):.4f}: {100 * gap:+.2f}%")
    assert last(zero3) < zero3[0] - 1.0  # it learned
    assert abs(gap) <= 0.02


def test_qgz_over_real_collectives_is_deepspeeds_all_to_all_quant_reduce():
    """The transcribed oracle takes whole 2-D gradients and groups them by rows (``max(rows, cols,
    world)`` groups); a (world x k, g) gradient with ``world x k >= g`` is grouped exactly as raydeep
    groups a flat unit whose shards hold k groups of g values. DeepSpeed's result is the fp16 sum
    of the node chunks times 1/nodes; raydeep's is that sum (the strategy divides by the world
    size): with 2 nodes, exactly twice DeepSpeed's."""
    from tests.dist.deepspeed_zeropp_oracle import all_to_all_quant_reduce_world
    from tests.dist.zeropp_workloads import qgz_reduce_scatter

    group, k = 16, 8  # 4 x 8 = 32 rows >= 16 columns
    gen = torch.Generator().manual_seed(3)
    # fp16: the kernels read fp16, and raydeep converts a gradient to it first
    per_rank = [(torch.randn(WORLD * k, group, generator=gen) * (1 + r)).half() for r in range(WORLD)]
    ours = run_ranks(qgz_reduce_scatter, WORLD, per_rank, group)
    theirs = all_to_all_quant_reduce_world(per_rank, nodes=2, devices_per_node=2)
    total = torch.stack(per_rank).float().sum(0).reshape(-1)
    exact = [total[r * k * group:(r + 1) * k * group] for r in range(WORLD)]
    for r in range(WORLD):
        assert torch.equal(ours[r], (theirs[r].float() * 2)), r
        # and it is the sum, up to int4 quantization twice (a coarse bound: one step of 1/7 of the
        # largest value per quantization, on values up to 4 ranks x 4 sigma)
        assert (ours[r] - exact[r]).abs().max() < 0.5 * exact[r].abs().max()


def test_checkpoints_hold_exact_weights_and_resume_bit_for_bit(tmp_path):
    """Nothing quantized is saved: the weights read back after a load are the ones saved (exact
    shards, not qwZ's int8 gathers), and the resumed run is the straight run, bit for bit (the
    secondary partitions are rebuilt from the loaded shards)."""
    from tests.dist.zeropp_workloads import checkpoint_round_trip

    cfg = zeropp_config("bf16", **ALL_THREE)
    out = run_ranks(checkpoint_round_trip, WORLD, str(tmp_path / "ckpt"), cfg, 2, 2)[0]
    assert out["resumed"] == out["straight"]
    for name, value in out["saved"].items():
        assert torch.equal(out["loaded"][name], value), name
        assert torch.equal(out["resumed_params"][name], out["straight_params"][name]), name
    # and the saved weights are not int8 levels: requantizing a weight matrix changes it
    from raydeep.zero import quantize

    weight = max(out["saved"].values(), key=lambda t: t.numel())
    values, scales = quantize.quantize_weights(weight.reshape(-1))
    assert not torch.equal(quantize.dequantize_weights(values, scales, torch.float32, numel=weight.numel()),
                           weight.reshape(-1).half().float())
