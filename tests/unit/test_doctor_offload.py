"""The doctor's offload prediction: the arithmetic from given rates, and its verdict on the delay."""
from __future__ import annotations

import pytest

from raydeep.config import load_config
from raydeep.doctor import Cluster, ModelShape, diagnose
from raydeep.doctor.offload import OffloadRates, measured_cpu_rate, predict_offload

CONFIG = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def test_the_offloaded_step_is_the_longer_of_update_and_transfer():
    shape = ModelShape.from_gpt("gpt2-medium")
    cfg = load_config(CONFIG, world_size=4)
    rates = OffloadRates(cpu_elements_per_s=1e9, threads=4, bandwidth=25e9)
    t = predict_offload(cfg, shape, 4, rates)
    elements = -(-shape.params // 4)
    assert t.elements == elements
    assert t.update_s == pytest.approx(elements / 4e9)
    assert t.transfer_s == pytest.approx(2 * 2 * elements / 25e9)  # bf16 gradients there, parameters back
    assert t.added_s == pytest.approx(max(t.update_s, t.transfer_s) + min(t.update_s, t.transfer_s) / 8)
    assert t.compute_s is None and t.hidden_by_delay is None and not t.delayed
    assert "at least" in t.describe()


def test_the_delay_hides_the_update_only_behind_enough_compute():
    shape = ModelShape.from_gpt("gpt2-medium")
    cfg = load_config({**CONFIG, "raydeep": {"delayed_update": True}}, world_size=4)
    fast_device = predict_offload(cfg, shape, 4, OffloadRates(1e9, 4, 25e9, device_tflops=1e6))
    slow_device = predict_offload(cfg, shape, 4, OffloadRates(1e9, 4, 25e9, device_tflops=10))
    assert fast_device.delayed and fast_device.hidden_by_delay is False and "remain" in fast_device.describe()
    assert slow_device.hidden_by_delay is True and "would hide it (" in slow_device.describe()


def test_the_lookahead_adds_its_terms_to_what_the_delay_must_hide():
    """With the lookahead (the default) the update writes two terms in its pass and both travel
    back instead of the parameters; with the plain rule the background work is update + transfer."""
    shape = ModelShape.from_gpt("gpt2-medium")
    rates = OffloadRates(1e9, 4, 25e9)
    ahead = predict_offload(load_config({**CONFIG, "raydeep": {"delayed_update": True}}, world_size=4), shape, 4,
                            rates)
    plain = predict_offload(load_config({**CONFIG, "raydeep": {"delayed_update": True,
                                                                "delayed_update_lookahead": False}}, world_size=4),
                            shape, 4, rates)
    assert plain.delayed_busy_s == pytest.approx(plain.update_s + plain.transfer_s)
    assert ahead.delayed_busy_s == pytest.approx(ahead.update_s * 1.45 + ahead.transfer_s * 1.5)
    assert ahead.update_s == plain.update_s and ahead.added_s == plain.added_s  # without the delay: the same
    assert f"at least {ahead.delayed_busy_s * 1e3:.0f} ms" in ahead.describe()


def test_no_prediction_without_offload_and_a_real_measurement():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}, world_size=2)
    assert predict_offload(cfg, ModelShape.from_gpt("gpt-tiny"), 2, OffloadRates(1e9, 1, 1e9)) is None
    report = diagnose(CONFIG, ModelShape.from_gpt("gpt-tiny"), Cluster(world_size=2),
                      offload_rates=OffloadRates(measured_cpu_rate(numel=1 << 16, reps=1), 1, 25e9))
    assert report.offload is not None and report.offload.update_s > 0
    assert report.as_dict()["offload"]["elements"] == report.offload.elements
