"""``raydeep bench --zeropp``: which rows it adds and what it refuses (the rows themselves run in
tests/dist/test_zeropp.py's engine tests; the bench only times them)."""
from types import SimpleNamespace

from raydeep.bench.run import plan, zeropp_variants
from raydeep.cli import main


def test_zeropp_adds_one_stage_3_row_per_part_and_one_for_all_three():
    opts = SimpleNamespace(overlap=(None,), deepspeed=False, zeropp=2)
    rows = [r for r in plan(opts) if r[3]]
    assert rows == [("raydeep", 3, None, v) for v in ("hpZ", "qwZ", "qgZ", "ZeRO++")]
    assert zeropp_variants(2)["ZeRO++"] == {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                            "zero_quantized_gradients": True}
    assert not [r for r in plan(SimpleNamespace(overlap=(None,), deepspeed=False, zeropp=0)) if r[3]]


def test_ranks_per_node_must_divide_the_world(capsys):
    assert main(["bench", "--world", "4", "--zeropp", "3"]) == 2
    assert "--zeropp" in capsys.readouterr().err
