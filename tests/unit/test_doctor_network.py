"""The doctor's ZeRO++ byte split and communication-time verdict (raydeep.doctor.traffic,
raydeep.doctor.network): what crosses between nodes for each ZeRO++ part against plain ZeRO-3, the
verdict's flip with the bandwidth, bandwidth parsing, and the CLI end to end."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydeep.config import load_config
from raydeep.doctor.network import CodecRates, Links, parse_bandwidth, plan_network
from raydeep.doctor.shape import Cluster, ModelShape
from raydeep.doctor.stage3 import persistent_params
from raydeep.doctor.traffic import predict_compressed_traffic, predict_traffic, quantized_weight_bytes

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 16, 8
WORLD = NODES * PER_NODE
# A 1.3B-class GPT whose block shards over 128 ranks quantize in groups of 4096 values.
SHAPE = ModelShape.from_counts(1_300_000_000, 24, 2048, 2048, 50257)


def _cfg(gas: int = 1, **zero) -> object:
    return load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "bf16": {"enabled": True},
                        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, **zero}}, world_size=WORLD)


def _cross(**zero) -> int:
    return predict_traffic(_cfg(**zero), SHAPE, PER_NODE).cross_node_bytes


def _cross_by_op(traffic, prefix: str) -> int:
    return sum(cross for op, (_, cross) in traffic.links_by_op.items() if op.startswith(prefix))


def test_hpz_keeps_backward_gathers_inside_the_node():
    plain, hpz = predict_traffic(_cfg(), SHAPE, PER_NODE), predict_traffic(_cfg(zero_hpz_partition_size=PER_NODE), SHAPE, PER_NODE)
    assert hpz.links_by_op["all_gather_secondary"][1] == 0  # backward's gathers: no byte leaves the node
    assert hpz.links_by_op["all_gather_secondary"][0] > 0
    # what still crosses is the forward's primary gather (and the persistent re-gather): about half
    # the gathers (backward skips the root unit, so a little more than half)
    share = _cross_by_op(hpz, "all_gather") / _cross_by_op(plain, "all_gather")
    assert 0.5 <= share <= 0.55
    assert hpz.cross_node_bytes < plain.cross_node_bytes


def test_qwz_gathers_about_half_the_bytes_of_16_bit_weights():
    plain = predict_traffic(_cfg(), SHAPE, PER_NODE)
    qwz = predict_traffic(_cfg(zero_quantized_weights=True), SHAPE, PER_NODE)
    ratio = qwz.links_by_op["all_gather_quantized"][1] / plain.links_by_op["all_gather"][1]
    # int8 values (half of bf16) plus one fp32 scale per group of the shard (4096 values here)
    overhead = quantized_weight_bytes(SHAPE.block_params, WORLD) - 1
    assert 0 < overhead < 0.01
    assert ratio == pytest.approx(0.5 * (1 + overhead), rel=0.002)
    assert qwz.codec_passes["int8"] > 0


def test_qgz_sends_about_a_quarter_of_the_reduce_scatter_across_nodes():
    plain = predict_traffic(_cfg(), SHAPE, PER_NODE)
    qgz = predict_traffic(_cfg(zero_quantized_gradients=True), SHAPE, PER_NODE)
    assert qgz.links_by_op["quantized_reduce_scatter/local"][1] == 0  # the first phase stays in the node
    matrices = (SHAPE.params - persistent_params(_cfg(), SHAPE)) / SHAPE.params  # the rest stays plain
    quarter = _cross_by_op(qgz, "quantized_reduce_scatter") / (plain.links_by_op["reduce_scatter"][1] * matrices)
    # int4 values over 1/8 of the data sent to 15 of 16 nodes, against bf16 over a ring of 128 ranks
    # (127/128 of it, 1/8 per rank crossing); scales: one fp32 per ~hidden values
    scales = 4 / SHAPE.hidden / 0.5
    spread = ((NODES - 1) / NODES) / ((WORLD - 1) / WORLD)
    assert quarter == pytest.approx(0.25 * (1 + scales) * spread, rel=0.01)


def test_all_three_cut_cross_node_bytes_to_at_most_thirty_percent():
    plain = _cross()
    zeropp = _cross(zero_hpz_partition_size=PER_NODE, zero_quantized_weights=True, zero_quantized_gradients=True)
    assert zeropp <= 0.30 * plain
    assert zeropp >= 0.20 * plain  # 0.5 M + 0.25 M of 3 M, plus scales and the exact vectors


def test_one_node_sends_nothing_across_nodes():
    cfg = _cfg(zero_quantized_weights=True)
    assert predict_traffic(cfg, SHAPE, WORLD).cross_node_bytes == 0
    assert predict_traffic(cfg, SHAPE).cross_node_bytes == 0  # no node map given: one node


def test_onebit_sends_about_a_32nd_of_a_ring_all_reduce():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}, world_size=WORLD)
    shape = ModelShape.from_counts(WORLD * 10**6, 2, 64, 16, 100)
    plain = predict_traffic(cfg, shape, PER_NODE)  # fp32 all-reduce
    compressed = predict_compressed_traffic(cfg, shape, PER_NODE)
    assert compressed.ring_bytes / plain.ring_bytes == pytest.approx(1 / 32, rel=0.02)


def _plan(bandwidth: str, rate: float = 2e11):
    cluster = Cluster(world_size=WORLD, gpus_per_node=PER_NODE)
    links = Links(parse_bandwidth(bandwidth), parse_bandwidth("300GB"))
    return plan_network(_cfg(gas=4), SHAPE, cluster, links, CodecRates.given(rate))


def test_verdict_flips_between_25_and_400_gbps_for_one_quantization_cost():
    slow, fast = _plan("25Gbps"), _plan("400Gbps")
    assert slow.recommended.name == "ZeRO++ (hpZ + qwZ + qgZ)", slow.verdict
    assert "use it" in slow.verdict and "zero_quantized_gradients=true" in slow.verdict
    assert fast.recommended.codec_s == 0, fast.verdict  # nothing quantized at 400 Gbps
    assert "costs more than it saves" in fast.verdict
    zeropp = next(o for o in slow.options if o.name.startswith("ZeRO++"))
    assert parse_bandwidth("25Gbps") < zeropp.pays_below < parse_bandwidth("400Gbps")


def test_a_slower_quantizer_moves_the_break_even_down():
    def pays_below(rate):
        return next(o.pays_below for o in _plan("100Gbps", rate).options if o.name == "ZeRO-3 + qwZ")
    assert pays_below(1e10) < pays_below(1e11) < pays_below(1e12)


def test_every_collective_launched_costs_the_latency():
    cluster = Cluster(world_size=WORLD, gpus_per_node=PER_NODE)
    links = Links(parse_bandwidth("100Gbps"), parse_bandwidth("300GB"))
    plans = [plan_network(_cfg(gas=4), SHAPE, cluster, Links(links.network, links.intra_node, latency),
                          CodecRates.given(2e11)) for latency in (0.0, 1e-3)]
    for without, per_ms in zip(*(p.options for p in plans)):
        launched = sum(without.traffic.calls_by_op.values())
        # per micro-step a gather per block and the root (backward gathers the blocks again at
        # reuse distance 0), a reduce-scatter per unit and the persistent one; quantized gathers
        # and qgZ reduce-scatters launch values and scales apart
        assert launched >= 4 * (2 * SHAPE.layers + 1 + SHAPE.layers + 2)
        assert per_ms.total_s - without.total_s == pytest.approx(1e-3 * launched)
        assert per_ms.latency_s == pytest.approx(1e-3 * launched) and without.latency_s == 0
    # hpZ's secondary gathers and qgZ's first phase run over the ranks of one node: with a free
    # in-node latency they cost nothing, and every other collective the full one
    split = plan_network(_cfg(gas=4), SHAPE, cluster, Links(links.network, links.intra_node, 1e-3, 0.0),
                         CodecRates.given(2e11))
    for option in split.options:
        across = sum(option.traffic.calls_by_op.values()) - option.traffic.in_node_calls
        assert option.latency_s == pytest.approx(1e-3 * across)
    in_node = {o.name: o.traffic.in_node_calls for o in split.options}
    assert in_node["ZeRO-3"] == in_node["ZeRO-3 + qwZ"] == 0
    assert in_node["ZeRO-3 + hpZ"] > 0 and in_node["ZeRO-3 + qgZ"] > 0


@pytest.mark.parametrize("text", ["25", "25gb", "25 Gbs", "fast", "-3Gbps", "0Gbps", "25Gbps/rack", "1e999GB"])
def test_bad_bandwidths_are_refused(text):
    with pytest.raises(ValueError, match="not a bandwidth"):
        parse_bandwidth(text)


def test_bandwidth_units():
    assert parse_bandwidth("25Gbps") == parse_bandwidth("25 Gb/s") == parse_bandwidth("3.125GB/s") == 3.125e9
    assert parse_bandwidth("600GB") == 600e9 and parse_bandwidth("1Tbps") == 125e9


@pytest.fixture
def doctor(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                  "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    return lambda *args: _doctor(str(config), *args)


def _doctor(config: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "raydeep", "doctor", config,
                           "--params", "1.3e9", "--layers", "24", "--hidden", "2048", "--seq", "2048", "--vocab",
                           "50257", "--nodes", str(NODES), "--gpus-per-node", str(PER_NODE), "--quantize-rate", "2e11",
                           "--cpu-update-rate", "1e8", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_the_verdict_and_json(doctor):
    text = doctor("--bandwidth", "25Gbps")
    assert "verdict (network): at 25 Gbps per rank between nodes ZeRO++ (hpZ + qwZ + qgZ)" in text.stdout, text.stderr
    as_json = doctor("--bandwidth", "3200Gbps/node", "--json")
    network = json.loads(as_json.stdout)["network"]
    assert network["bandwidth_bytes_s"] == pytest.approx(50e9)  # a node's 3.2 Tbps over its 8 GPUs
    assert network["recommended"] != "ZeRO++ (hpZ + qwZ + qgZ)"
    assert {o["name"] for o in network["options"]} >= {"ZeRO-3", "ZeRO-3 + hpZ", "ZeRO-3 + qwZ", "ZeRO-3 + qgZ"}
    assert all(math.isfinite(o["total_s"]) for o in network["options"])


def test_cli_names_the_flag_of_a_bad_bandwidth(doctor):
    result = doctor("--bandwidth", "25gb")
    assert result.returncode == 2
    assert "--bandwidth = '25gb': is not a bandwidth" in result.stderr
    assert "25Gbps" in result.stderr and "Traceback" not in result.stderr


def test_the_memory_plan_counts_hpzs_secondary_partition():
    from raydeep.config import load_config
    from raydeep.doctor.memory import plan_memory
    from raydeep.doctor.shape import ModelShape

    shape = ModelShape.from_counts(10**9, 24, 2048, 1024, 50_000)
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    plain = plan_memory(load_config(base, world_size=16), shape)
    hpz = plan_memory(load_config({**base, "zero_optimization": {**base["zero_optimization"],
                                                                 "zero_hpz_partition_size": 8}}, world_size=16), shape)
    rows = {r.name: r.bytes for r in hpz.device_rows}
    assert rows["hpZ secondary partition"] == 2 * 10**9 // 8
    assert hpz.model_states - plain.model_states == 2 * 10**9 // 8
