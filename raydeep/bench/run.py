"""``raydeep bench``: step time of raydeep's ZeRO stages against DDP, torch's ZeRO-1, FSDP2 and
DeepSpeed, in one invocation, on the same model init and data.

``--world`` gloo ranks on this machine build every contender (:mod:`raydeep.bench.engines`) in one
process group. The contenders take turns one optimizer step at a time, the starting one rotated
every round, so a change in the machine's load hits them all alike; each round is one repetition.
A step's time is the slowest rank's, from a barrier to the end of the step. Per contender the
report gives the median and quartiles over the measured rounds, the ratios to DDP, to DeepSpeed
at the same stage and to the torch peer of the same layout (DDP, ZeRO-1, FSDP2 grad-op, FSDP2),
the largest loss difference to raydeep z0 over the run (all train the same fp32 AdamW, so they
agree to rounding), the model-state bytes per rank against the ZeRO formula, and for raydeep the
bytes per step against the doctor's prediction (:func:`raydeep.doctor.traffic.predict_traffic`).
"""
from __future__ import annotations

import os
import statistics
import time
from importlib.util import find_spec

import torch

from raydeep.bench import engines
from raydeep.bench.ranks import on_gloo_ranks, on_ray_ranks

PEER_OF_STAGE = {0: "DDP", 1: "torch ZeRO-1", 2: "FSDP2 grad-op", 3: "FSDP2"}


def zeropp_variants(ranks_per_node: int) -> dict[str, dict]:
    """The ZeRO++ rows (``--zeropp``): each part alone and all three, as ``zero_optimization`` keys."""
    parts = {"hpZ": {"zero_hpz_partition_size": ranks_per_node}, "qwZ": {"zero_quantized_weights": True},
             "qgZ": {"zero_quantized_gradients": True}}
    return {**parts, "ZeRO++": {k: v for part in parts.values() for k, v in part.items()}}


def plan(opts) -> list[tuple]:
    """(family, stage, overlap, ZeRO++ variant) for every contender, in building order."""
    runs = [("raydeep", 0, None, "")] + [("raydeep", s, o, "") for s in (1, 2, 3) for o in opts.overlap]
    runs += [("raydeep", 3, None, v) for v in (zeropp_variants(opts.zeropp) if getattr(opts, "zeropp", 0) else ())]
    runs += [("ddp", 0, None, ""), ("torch-zero", 1, None, ""), ("fsdp2", 2, None, ""), ("fsdp2", 3, None, "")]
    if opts.deepspeed:
        runs += [("deepspeed", s, None, "") for s in range(4)]
    return runs


def build_model(opts):
    from raydeep.models import build_gpt

    torch.manual_seed(0)  # every contender starts from the same weights
    overrides = {"n_layer": opts.n_layer} if opts.n_layer else {}
    return build_gpt(opts.model, block_size=opts.seq, **overrides)


def build(opts, family: str, stage: int, overlap, variant: str = "") -> engines.Contender:
    model, world = build_model(opts), torch.distributed.get_world_size()
    cfg = engines.ds_config(opts.micro_batch, opts.gas, stage, opts.bucket, overlap, deepspeed=family == "deepspeed",
                            dtype=opts.dtype, lr=opts.lr)
    if family == "raydeep":
        if variant:
            cfg["zero_optimization"].update(zeropp_variants(opts.zeropp)[variant])
        return engines.raydeep_contender(model, cfg, stage, overlap, variant)
    if family == "deepspeed":
        return engines.deepspeed_contender(model, cfg, stage)
    if family in ("ddp", "torch-zero"):
        return engines.ddp_contender(model, opts.bucket, zero_optimizer=family == "torch-zero",
                                     bf16=opts.dtype == "bf16", lr=opts.lr)
    return engines.fsdp2_contender(model, world, reshard_after_forward=stage == 3, bf16=opts.dtype == "bf16",
                                  lr=opts.lr)


def batches(micro_batch: int, gas: int, seq: int, rank: int, world: int, steps: int,
            vocab: int) -> list[list[tuple]]:
    """Each step's micro-batches for this rank, sliced from one global batch per step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (micro_batch * gas * world, seq + 1), generator=g)
        micro = []
        for k in range(gas):
            lo = (k * world + rank) * micro_batch
            x = data[lo:lo + micro_batch]
            micro.append((x[:, :-1], x[:, 1:]))
        out.append(micro)
    return out


def measure(opts) -> dict:
    """On every rank: build every contender, run them round robin, return times and losses."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if getattr(opts, "zeropp", 0):
        os.environ["LOCAL_WORLD_SIZE"] = str(opts.zeropp)  # the declared nodes ZeRO++'s groups follow
    contenders = [build(opts, *run) for run in plan(opts)]
    vocab = build_model(opts).config.vocab_size
    data = batches(opts.micro_batch, opts.gas, opts.seq, rank, world, opts.warmup + opts.steps, vocab)
    times, losses = [[] for _ in contenders], [[] for _ in contenders]
    comm_before = blocked_before = [None] * len(contenders)
    for step, micro in enumerate(data):
        if step == opts.warmup:
            comm_before, blocked_before = [c.comm_bytes() for c in contenders], [c.blocked_s() for c in contenders]
        shift = step % len(contenders)
        for i in list(range(shift, len(contenders))) + list(range(shift)):
            dist.barrier()
            start = time.perf_counter()
            loss = contenders[i].step(micro)
            elapsed = time.perf_counter() - start
            losses[i].append(loss)
            if step >= opts.warmup:
                times[i].append(elapsed)
    comm = [None if b is None else (c.comm_bytes() - b) / opts.steps for c, b in zip(contenders, comm_before)]
    blocked = [None if b is None else (c.blocked_s() - b) / opts.steps for c, b in zip(contenders, blocked_before)]
    out = {"names": [c.name for c in contenders], "times": times, "losses": losses, "comm_bytes_per_step": comm,
           "blocked_s_per_step": blocked, "state_bytes": [c.state_bytes() for c in contenders]}
    for c in contenders:
        if c.family == "raydeep":
            c.engine.destroy()
    return out


def theory(opts, world: int) -> dict:
    """By stage: the ZeRO formula's model-state bytes per rank (fp32 Adam: 4 + 4 + 8 bytes per
    element, partitioned as the stage says; at stage 3 the parameters DeepSpeed's persistence
    thresholds keep whole count whole), and raydeep's predicted bytes per step."""
    from raydeep.config import load_config
    from raydeep.doctor.memory import persistent_params
    from raydeep.doctor.shape import ModelShape
    from raydeep.doctor.traffic import predict_traffic
    from raydeep.estimate import PRECISION_BYTES, estimate_model_states

    model = build_model(opts)
    numel = sum(p.numel() for p in model.parameters())
    shape = ModelShape.from_module(model, opts.seq)
    states, traffic = {}, {}
    for stage in range(4):
        cfg = load_config(engines.ds_config(opts.micro_batch, opts.gas, stage, opts.bucket, None, dtype=opts.dtype),
                          world_size=world)
        estimate = estimate_model_states(numel, world, stage, opts.dtype)
        params = estimate.params
        if stage == 3:
            persistent = persistent_params(cfg, shape)
            params = PRECISION_BYTES[opts.dtype] * (-(-(numel - persistent) // world) + persistent)
        states[stage] = params + estimate.grads + estimate.master + estimate.optimizer_states
        traffic[stage] = predict_traffic(cfg, shape).total
    return {"params": numel, "state_bytes": states, "comm_bytes_per_step": traffic}


def summarize(opts, per_rank: list[dict], expected: dict) -> dict:
    first = per_rank[0]
    rows = []
    for i, name in enumerate(first["names"]):
        family, stage, overlap, variant = plan(opts)[i]
        steps = [max(r["times"][i][s] for r in per_rank) for s in range(opts.steps)]  # the slowest rank's
        q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0],) * 3
        states = [r["state_bytes"][i] for r in per_rank]
        comm = first["comm_bytes_per_step"][i]
        rows.append({"name": name, "family": family, "stage": stage, "overlap_comm": overlap,
                     "median_s": statistics.median(steps), "q1_s": q1, "q3_s": q3, "step_s": steps,
                     "losses": first["losses"][i], "state_bytes": states if None not in states else None,
                     "state_bytes_formula": expected["state_bytes"][stage],
                     "comm_bytes_per_step": comm, "blocked_comm_s": _slowest(r["blocked_s_per_step"][i] for r in per_rank),
                     "comm_bytes_predicted": expected["comm_bytes_per_step"][stage]
                     if comm is not None and not variant else None})
    by_name = {r["name"]: r for r in rows}
    reference = by_name["raydeep z0"]["losses"]
    deepspeed = {r["stage"]: r["median_s"] for r in rows if r["family"] == "deepspeed"}
    for row in rows:
        row["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(row["losses"], reference))
        row["vs_ddp"] = row["median_s"] / by_name["DDP"]["median_s"]
        row["vs_deepspeed"] = row["median_s"] / deepspeed[row["stage"]] if row["stage"] in deepspeed else None
        peer = by_name[PEER_OF_STAGE[row["stage"]]]
        row["vs_peer"] = row["median_s"] / peer["median_s"] if row["family"] == "raydeep" else None
    hidden = {}
    for stage in (1, 2, 3):  # the share of the blocked time that overlap_comm hides
        pair = {r["overlap_comm"]: r["blocked_comm_s"] for r in rows if r["family"] == "raydeep" and r["stage"] == stage}
        if pair.get(False) and True in pair:
            hidden[stage] = 1 - pair[True] / pair[False]
    return {"setup": {k: v for k, v in vars(opts).items() if k not in ("func", "out", "timeout")},
            "params": expected["params"], "rows": rows, "hidden_comm_share": hidden}


def _slowest(values) -> float | None:
    values = list(values)
    return None if None in values else max(values)


def run(opts) -> dict:
    """Spawn the ranks, collect their measurements, summarize them."""
    if opts.deepspeed and find_spec("deepspeed") is None:
        opts.deepspeed = False  # the report says so
    load_at_start = os.getloadavg()[0]  # other work on the machine skews every number: report it
    started = time.time()
    if getattr(opts, "ray", False):
        per_rank = on_ray_ranks(opts.world, measure, (opts,), threads=opts.threads, timeout=opts.timeout,
                                address=opts.address)
    else:
        per_rank = on_gloo_ranks(opts.world, measure, (opts,), threads=opts.threads, timeout=opts.timeout)
    summary = summarize(opts, per_rank, theory(opts, opts.world))
    summary["machine"] = {"cpus": os.cpu_count(), "load_average_start": load_at_start,
                          "load_average_end": os.getloadavg()[0], "seconds": time.time() - started,
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                          "torch": torch.__version__, "deepspeed": opts.deepspeed,
                          "ranks": "Ray actors" if getattr(opts, "ray", False) else "local processes"}
    return summary
