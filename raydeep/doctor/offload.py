"""What optimizer offload adds to a step, and whether the delayed update would hide it.

An offloaded step moves each rank's gradient shard to the CPU (or an offload actor), updates the
fp32 masters there and moves the parameters back, both in the model dtype; the pieces pipeline, so
what the step waits for is about the longer of the CPU update and the transfers (plus one piece of
the other to fill the pipe). The delayed parameter update (``raydeep.delayed_update``) runs all of
it while the next forward and backward run: it is hidden when those take longer. With its lookahead
(``raydeep.delayed_update_lookahead``, the default) the update also writes two model-dtype terms in
its pass and both travel back instead of the parameters: about 1.45x the CPU time (the fused pass
with and without them: 3.1 ms against 2.1 ms for 4M elements on one thread) and 3 model-dtype
bytes per element over the link instead of 2.

The inputs are rates, measured or given: the CPU update's elements per second per thread (the
doctor measures this machine's with ``raydeep.tier.cpu_update.benchmark`` unless told), the
threads each rank's update gets, the host-device (or network) bandwidth, and the device's dense
TFLOP/s for the forward and backward (6 x parameters x tokens at 40% of peak).
"""
from __future__ import annotations

from dataclasses import dataclass

PIECES = 8  # a shard's pieces in flight over a step: the pipe fills for one of them
MFU = 0.4  # the share of peak a forward and backward reach, for the estimate
LOOKAHEAD_UPDATE = 1.45  # the CPU update with the lookahead's terms, against without (see above)


@dataclass(frozen=True)
class OffloadRates:
    cpu_elements_per_s: float  # the CPU update, per thread
    threads: int
    bandwidth: float  # bytes per second each way between the rank and where the masters live
    device_tflops: float | None = None  # dense peak, for the forward and backward estimate


@dataclass(frozen=True)
class OffloadTime:
    elements: int  # per rank
    update_s: float
    transfer_s: float
    added_s: float  # what the step waits for without the delay
    compute_s: float | None  # forward and backward, when the device rate is known
    delayed: bool  # the config turns the delayed update on
    delayed_busy_s: float  # the background work under the delayed update (its lookahead's included)

    @property
    def hidden_by_delay(self) -> bool | None:
        return None if self.compute_s is None else self.compute_s >= self.delayed_busy_s

    def describe(self) -> str:
        text = (f"optimizer offload: {self.elements:,} elements per rank, CPU update {self.update_s * 1e3:.0f} ms, "
                f"transfers {self.transfer_s * 1e3:.0f} ms; the step waits about {self.added_s * 1e3:.0f} ms for it")
        busy = self.delayed_busy_s
        if self.compute_s is None:
            verdict = (f"the delayed update would hide it where forward and backward take at least "
                       f"{busy * 1e3:.0f} ms (pass --device-tflops to estimate them)")
        elif self.hidden_by_delay:
            verdict = (f"forward and backward take about {self.compute_s * 1e3:.0f} ms: the delayed update would "
                       "hide it")
        else:
            verdict = (f"forward and backward take about {self.compute_s * 1e3:.0f} ms: the delayed update would "
                       f"hide {self.compute_s * 1e3:.0f} ms of it, {max(0.0, busy - self.compute_s) * 1e3:.0f} ms "
                       "remain")
        state = "on in this config" if self.delayed else "raydeep.delayed_update, off in this config"
        return f"{text}; {verdict} ({state})"


def predict_offload(cfg, shape, world_size: int, rates: OffloadRates) -> OffloadTime | None:
    """None when the config does not offload the optimizer."""
    zero = cfg.zero_optimization
    opt = zero.offload_optimizer
    if opt is None or opt.device == "none" or zero.stage == 0:
        return None
    elements = -(-shape.params // world_size) if zero.stage >= 1 else shape.params
    model_bytes = 4 if cfg.precision == "fp32" else 2
    update = elements / (rates.cpu_elements_per_s * max(1, rates.threads))
    transfer = 2 * elements * model_bytes / rates.bandwidth  # gradients there, parameters back
    added = max(update, transfer) + min(update, transfer) / PIECES
    compute = None
    if rates.device_tflops:
        tokens = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * shape.seq
        compute = 6 * shape.params * tokens / (rates.device_tflops * 1e12 * MFU)
    delayed = cfg.raydeep.delayed_update or bool(zero.zenflow and zero.zenflow.overlap_step)
    busy = update + transfer
    if cfg.raydeep.delayed_update_lookahead:  # the terms in the update's pass; base and rate come back
        busy = update * LOOKAHEAD_UPDATE + transfer * 3 / 2
    return OffloadTime(elements, update, transfer, added, compute, delayed, busy)


def measured_cpu_rate(numel: int = 1 << 20, reps: int = 3) -> float:
    """This machine's CPU update rate on one thread (elements/s): the tier's own AdamW step on a bf16
    gradient into a bf16 parameter, the median of ``reps`` after a warm-up."""
    import statistics
    import time

    import torch

    from raydeep.tier.masters import MasterShards, plan_sub_groups

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grad, out = torch.randn(numel).to(torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
        shards = MasterShards(plan_sub_groups([numel], [0], 10**9), [torch.randn(numel)], [{}],
                              lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=True), threads=1)
        took = []
        for _ in range(reps + 1):
            began = time.perf_counter()
            shards.step_sub_group(0, [grad], 0.5, outs=[out])
            took.append(time.perf_counter() - began)
        return numel / statistics.median(took[1:])
    finally:
        torch.set_num_threads(previous)
