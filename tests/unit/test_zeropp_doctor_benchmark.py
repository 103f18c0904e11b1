"""benchmarks/zeropp_doctor without its ranks: every case's config loads, the doctor's prediction for
it counts the collectives the engine launches (tests/dist/test_zeropp.py checks those against a
run), and the table renders."""
from __future__ import annotations

import argparse

from benchmarks import zeropp_doctor
from raydeep.doctor.network import CodecRates


def _opts(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{"model": "gpt-tiny", "seq": 64, "world": 4, "per_node": 2, "steps": 2, "reuse": 0,
                                 "overlap": False, "aligned": False, **changes})


def test_every_case_is_predicted_and_rendered():
    opts, rates = _opts(), CodecRates.given(1e9)
    rows = []
    for case in zeropp_doctor.CASES:
        predicted = zeropp_doctor.predict(opts, case, 1e-3, 1e9, rates, inside=5e-4)
        predicted["calibrated_s"] = predicted["comm_s"]
        assert predicted["collectives"] > 0 and predicted["bytes"] > 0
        assert predicted["comm_s"] == predicted["moved_s"] + predicted["latency_s"]
        rows.append({"case": case, "predicted": predicted, "collectives": predicted["collectives"],
                     "bytes": predicted["bytes"], "blocked_s": predicted["comm_s"], "blocked_min_s": 0.0,
                     "blocked_max_s": 0.0, "step_s": 0.1})
    by_case = {r["case"]: r["predicted"] for r in rows}
    # hpZ's secondary gathers run inside a node, at the in-node latency: the same collectives cost less
    assert by_case["hpZ"]["collectives"] == by_case["ZeRO-3"]["collectives"]
    assert by_case["hpZ"]["latency_s"] < by_case["ZeRO-3"]["latency_s"]
    result = {"setup": vars(opts), "latency_s": 1e-3, "intra_node_latency_s": 5e-4, "bandwidth_bytes_s": 1e9,
              "step_latency_s": 1e-3, "codec": rates.source, "rows": rows, "load_average": 0.0}
    table = zeropp_doctor.render(result)
    assert all(case in table for case in zeropp_doctor.CASES) and "0.50 ms inside a node" in table
