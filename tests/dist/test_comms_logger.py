"""comms_logger on two gloo ranks: DeepSpeed's ``log_summary`` rows agree with the engine's own
counters (``engine.comm_stats()``) op by op -- the count of calls and, through DeepSpeed's
message size (what each rank hands in), the bytes -- and rank 0 logs the table every
steps_per_print steps while rank 1 logs nothing."""
from __future__ import annotations

import logging

import pytest

from tests.dist.harness import run_ranks

GAS, MICRO, STEPS = 2, 2, 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def logged_training(stage: int) -> dict:
    """Train with comms_logger on; the rank's summary, counters and raydeep log lines."""
    import torch.distributed as dist

    import raydeep
    from raydeep import comm
    from tests.dist.workloads import config, run_steps, tiny_gpt

    lines, log = _Lines(), logging.getLogger("raydeep")
    log.addHandler(lines)
    level, log.level = log.level, logging.INFO
    # A pooled rank may have run a workload whose imports reconfigured logging (dictConfig with
    # disable_existing_loggers, logging.disable): this one reads the raydeep logger's lines.
    disabled, log.disabled = log.disabled, False
    floor = logging.root.manager.disable
    logging.disable(logging.NOTSET)
    try:
        model = tiny_gpt()
        broadcast = len(list(model.parameters())) + len(list(model.buffers()))  # rank 0's weights, at build
        cfg = config(stage, GAS, MICRO, 1.0, comms_logger={"enabled": True}, steps_per_print=STEPS)
        engine, *_ = raydeep.initialize(model=model, config=cfg)
        run_steps(engine, STEPS, MICRO * GAS * dist.get_world_size())
        summary = comm.log_summary(return_dict=True)["summary"]
        stats = engine.comm_stats()
        engine.destroy()
        return {"summary": summary, "comm": stats, "messages": lines.messages, "broadcast": broadcast,
                "world": dist.get_world_size()}
    finally:
        comm.configure_comms_logger(None)  # the pooled rank runs other tests next
        log.removeHandler(lines)
        log.setLevel(level)
        log.disabled = disabled
        logging.disable(floor)


def _table_rows(text: str) -> dict[str, dict[str, int]]:
    """{op: {message size text: count}} from the logged table."""
    rows: dict[str, dict[str, int]] = {}
    op = None
    for line in text.splitlines()[1:]:
        if not line.startswith(" "):
            op = line
            rows[op] = {}
            continue
        size, count = line[20:40].strip(), int(line[40:60])
        rows[op][size] = count
    return rows


@pytest.mark.parametrize("stage", [0, 2])
def test_summary_rows_match_the_engines_counters(stage):
    from raydeep.comm.comms_logging import DEEPSPEED_NAMES, convert_size

    ranks = run_ranks(logged_training, 2, stage)
    for rank, result in enumerate(ranks):
        summary, stats, world = result["summary"], result["comm"], result["world"]
        assert stats, "the stage moves gradients"
        for op, counted in stats.items():
            rows = summary[DEEPSPEED_NAMES[op]]
            assert sum(r["count"] for r in rows.values()) == counted["calls"], (rank, op)
            per_rank = sum(size * r["count"] for size, r in rows.items())
            # comm_stats counts the gathered output; DeepSpeed's message is each rank's input.
            assert per_rank * (world if op == "all_gather" else 1) == counted["bytes"], (rank, op)
            assert all(r["total_latency_ms"] > 0 for r in rows.values()), (rank, op)
        # The start-up broadcasts were logged too (comm_stats is reset after them, DeepSpeed logs them).
        assert sum(r["count"] for r in summary["broadcast"].values()) == result["broadcast"]
        assert set(summary) == {DEEPSPEED_NAMES[op] for op in stats} | {"broadcast"}
    # The engine's table at step STEPS (== steps_per_print), then the workload's log_summary():
    # nothing the logger records runs in between, so both show the final summary.
    tables = [m for m in ranks[0]["messages"] if m.startswith("Comm. Op")]
    assert len(tables) == 2
    assert not [m for m in ranks[1]["messages"] if m.startswith("Comm. Op")]
    expected = {op: {convert_size(size): r["count"] for size, r in rows.items()}
                for op, rows in ranks[0]["summary"].items()}
    assert _table_rows(tables[0]) == _table_rows(tables[1]) == expected
