"""`raydeep doctor`: the memory table follows the ZeRO formula, the verdict and the fixes are
consistent with the memory model, and the exit status says errors / warnings / clean."""
import json

import pytest

from raydeep.cli import main
from raydeep.config import load_config
from raydeep.doctor import Cluster, diagnose, format_report
from raydeep.doctor.fit import apply_change
from raydeep.doctor.memory import activation_bytes, persistent_params, plan_memory
from raydeep.doctor.shape import ModelShape, parse_bytes

SEED_175B = "jobs/configs/seed_175b_zero3_offload.json"
PSI, LAYERS, HIDDEN, SEQ, VOCAB = 175_000_000_000, 96, 12288, 2048, 50257
SHAPE_175B = ModelShape.from_counts(PSI, LAYERS, HIDDEN, SEQ, VOCAB)
CLUSTER_175B = Cluster(world_size=1024, gpus_per_node=8, device_memory=parse_bytes("80GB"),
                       host_memory=parse_bytes("1TB"))


def rows(plan) -> dict:
    return {row.name: row.bytes for row in plan.device_rows}


def test_175b_model_states_follow_the_zero_formula():
    report = diagnose(SEED_175B, SHAPE_175B, CLUSTER_175B)
    n, cfg = 1024, report.config
    persistent = persistent_params(cfg, SHAPE_175B)
    got = rows(report.memory)
    # fp32 (the config has no fp16/bf16 section), ZeRO-3, optimizer offloaded: on the device only
    # the fp32 weight partition (4 bytes x Psi / N) plus the persistent parameters, whole.
    assert got["params"] == 4 * -(-(PSI - persistent) // n) + 4 * persistent
    assert got["grads"] == got["master"] == got["optimizer_states"] == 0
    host = {row.name: row.bytes for row in report.memory.host_rows}
    # Host, per node of 8 ranks: fp32 master 4 + Adam 8 + fp32 gradient 4 bytes per partition element.
    part = -(-(PSI - persistent) // n)
    assert host["offloaded states"] == 8 * 16 * (part + -(-persistent // n))
    text = format_report(report)
    assert "ZeRO formula: params 4 Psi/1024" in text and "DOES NOT FIT" in text
    # The seed config's batch keys were written for one rank: a finding, and the estimate goes on.
    assert any(f.rule == "invalid-config" and f.key == "train_batch_size" for f in report.findings)
    assert report.exit_code == 2


def test_175b_mixed_precision_without_offload_is_2_2_12():
    raw = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    cfg = load_config(raw, world_size=1024)
    plan = plan_memory(cfg, SHAPE_175B)
    persistent = persistent_params(cfg, SHAPE_175B)
    part = -(-(PSI - persistent) // 1024)
    got = rows(plan)
    assert got["params"] == 2 * part + 2 * persistent
    assert got["grads"] == 2 * part + 2 * -(-persistent // 1024)
    assert got["master"] == 4 * part + 4 * -(-persistent // 1024)
    assert got["optimizer_states"] == 8 * part + 8 * -(-persistent // 1024)
    # The paper's 16 Psi / N, plus the persistent weights kept whole (2 bytes x 15.4M elements).
    assert plan.model_states == 16 * PSI / 1024 + 2 * persistent * (1 - 1 / 1024) + 16 * (part + -(-persistent // 1024) - (PSI / 1024))


def test_activation_checkpointing_choices_are_ordered():
    acts = [activation_bytes(SHAPE_175B, 1, "bf16", c) for c in ("none", "attention", "block")]
    assert acts[0] > acts[1] > acts[2]
    u = SEQ * HIDDEN * 2
    assert acts[0] == LAYERS * 17 * u + 2 * u + 2 * SEQ * VOCAB * 4


def test_each_fix_fits_when_applied():
    raw = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    shape = ModelShape.from_gpt("gpt-1.3b")
    cluster = Cluster(world_size=8, gpus_per_node=8, device_memory=parse_bytes("24GB"))
    report = diagnose(raw, shape, cluster)
    assert report.memory.fits is False and report.fixes
    assert [f.rule for f in report.findings if f.severity == "error"] == ["does-not-fit"]
    costs = [c.cost for c in report.fixes]
    assert costs == sorted(costs)
    for change in report.fixes:
        after = diagnose(apply_change(raw, change.settings), shape, cluster)
        assert after.memory.fits, change.title
        assert after.memory.device_total == change.plan.device_total


def test_exit_status_and_json(capsys, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                  "zero_optimization": {"stage": 3}}))
    args = ["doctor", str(config), "--model", "gpt-tiny", "--world-size", "2", "--gpu-memory", "16GB"]
    assert main(args) == 0  # clean
    assert main(args + ["--set", "zero_optimization.stage3_max_live_parameters=1000"]) == 1  # a warning
    assert main(args + ["--set", "zero_optimization.stage=4"]) == 2  # an invalid config
    assert main(args[:-1] + ["1MB"]) == 2  # does not fit
    capsys.readouterr()
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["fits"] is True
    assert out["memory"]["device"]["params"] > 0
    assert out["traffic"]["by_op"]["reduce_scatter"] > 0


def test_cli_175b_prints_the_table(capsys):
    code = main(["doctor", SEED_175B, "--params", "175e9", "--layers", "96", "--hidden", "12288", "--seq", "2048",
                 "--vocab", "50257", "--nodes", "128", "--gpus-per-node", "8", "--gpu-memory", "80GB",
                 "--cpu-memory", "1TB"])
    out = capsys.readouterr().out
    assert code == 2
    for text in ("per-rank device memory", "= model states", "activations", "gathered parameters",
                 "host memory per node", "communication per step", "changes that make it fit", "findings"):
        assert text in out, text


def test_model_given_twice_or_not_at_all_is_an_input_error(capsys):
    assert main(["doctor", SEED_175B, "--model", "gpt-tiny", "--params", "1e9", "--world-size", "2"]) == 2
    assert main(["doctor", SEED_175B, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "Traceback" not in err


def test_parse_bytes_refuses_nonsense():
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("eighty gigs")
