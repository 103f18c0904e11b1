"""``benchmarks/activation.py`` runs on the tiny GPT and reports every row (times are not checked:
benchmarks print them, tests do not judge them)."""
from benchmarks.activation import ROWS, main


def test_the_benchmark_reports_every_row(capsys, tmp_path):
    import json

    out = tmp_path / "rows.json"
    main(["--model", "gpt-tiny", "--micro", "1", "--reps", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == list(ROWS)
    assert all(any(line.startswith(row + " ") for line in printed.splitlines()) for row in ROWS)
    saved = {r["row"]: r["saved_bytes"] for r in rows}
    # the orders the choices must keep whatever the machine: fewer bytes kept with more checkpointed
    assert saved["block"] == saved["block+cpu"] == saved["block+contig"] < saved["every-k"] < saved["none"]
    assert saved["block"] < saved["attention"] < saved["none"]
    host = {r["row"]: r["host_bytes"] for r in rows}
    assert host["block+cpu"] == rows[0]["layers"] * rows[0]["block_input_bytes"] and host["block"] == 0
    allocations = {r["row"]: r["allocations"] for r in rows}
    # contiguous buffers on CPU: one more allocation (the buffer; the inputs are copied into it), none
    # fewer: the forward allocates the inputs anyway (measured: +1 exactly; +2 leaves room for a CPU whose
    # kernels allocate differently)
    assert allocations["block"] <= allocations["block+contig"] <= allocations["block"] + 2, allocations
    assert all(r["peak_step_bytes"] > 0 for r in rows)
    for r in rows:  # the doctor's estimate of the saved bytes, within 10% of the count
        assert abs(r["doctor_bytes"] / r["saved_bytes"] - 1) <= 0.10, r
