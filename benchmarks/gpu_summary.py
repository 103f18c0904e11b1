"""``summary.json`` of a GPU check, from whatever its stages left in OUT_DIR (standard library
only: it runs on a bare GPU image, and after any failure, from ``gpu_check.sh``'s exit trap).

    python benchmarks/gpu_summary.py OUT_DIR MODE LAST_STAGE EXIT_CODE

It names the stage that failed (the first with a non-zero exit, or the one running when the check
ended), each stage's exit and seconds, each GPU test's result from the junit report (the collected
tests on a dry run), the MFU benchmark's results as far as they got, the peak TFLOPS MFU was
measured against and the matmul rate the chip reached.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def stages(out: Path) -> dict[str, dict]:
    rows = {}
    path = out / "stages.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, code, seconds = line.split("\t")
        rows[name] = {"exit": int(code), "seconds": int(seconds), "timed_out": int(code) in (124, 137)}
    return rows


def tests(out: Path) -> dict[str, dict]:
    """Each test case in the junit report: passed, failed, error or skipped, with the message."""
    path = out / "junit.xml"
    if not path.exists():
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        return {"<junit.xml>": {"result": "unreadable", "message": str(err)}}
    results = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or "")[:500]
                break
        results[name] = {"result": outcome, "seconds": float(case.get("time") or 0), "message": message}
    return results


def collected(out: Path) -> list[str]:
    path = out / "tests.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip() for line in lines if "::" in line]


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1] if lines else ""


def summarise(out: Path, mode: str, last_stage: str, exit_code: int) -> dict:
    ran = stages(out)
    failed = next((name for name, row in ran.items() if row["exit"] != 0), None)
    if failed is None and exit_code != 0:
        failed = last_stage  # ended inside this stage (killed, or a step outside any stage)
    summary = {"mode": mode or "run", "exit": exit_code, "failed_stage": failed, "stages": ran,
               "failure": last_line(out / f"{failed}.txt") if failed else None}
    try:
        mfu = json.loads((out / "mfu.json").read_text())
    except (OSError, ValueError):
        mfu = None
    summary.update(peak_tflops=mfu and mfu.get("peak_tflops"), peak_source=mfu and mfu.get("peak_source"),
                   matmul_tflops=mfu and mfu.get("matmul_tflops"))
    if mode == "--dry-run":
        summary["collected"] = collected(out)
    else:
        results = tests(out)
        summary["tests"] = results
        summary["test_counts"] = {k: sum(r["result"] == k for r in results.values())
                                  for k in ("passed", "failed", "error", "skipped")}
        summary["gpu"] = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None
    summary["mfu"] = mfu
    return summary


def main(argv: list[str]) -> None:
    out, mode, last_stage, exit_code = Path(argv[0]), argv[1], argv[2], int(argv[3])
    summary = summarise(out, mode, last_stage, exit_code)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    brief = {k: summary[k] for k in ("mode", "exit", "failed_stage", "failure", "peak_tflops", "matmul_tflops")}
    brief.update({k: summary[k] for k in ("test_counts",) if k in summary})
    print(json.dumps(brief))


if __name__ == "__main__":
    main(sys.argv[1:])
