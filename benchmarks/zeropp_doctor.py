"""The doctor's communication time against measured steps: ZeRO-3 and its ZeRO++ parts on gloo
ranks declared as nodes (``LOCAL_WORLD_SIZE``), the doctor given the links measured in the same run.

    python -m benchmarks.zeropp_doctor [--world 4] [--per-node 2] [--steps 6] [--reuse 0] [--overlap]
                                       [--json out.json]

On every rank, before training, raydeep's own collectives over loopback give the links, each
timed after a few milliseconds of compute (as a step issues them):

- **latency**: the median seconds of an all-gather of 8 values;
- **bandwidth**: the bytes each rank sends per second in an all-gather of 2 MB per rank, its
  latency taken off.

Then each case trains the GPT (``--model``, bf16, stage 3, micro-batch 2, accumulation 2) for one
warm-up step and ``--steps`` measured ones. The table gives, per step and rank:

- **collectives** and **bytes**: the doctor's (:func:`raydeep.doctor.traffic.predict_traffic`)
  against what the engine counted (``engine.comm_stats()``, scalars included in the collectives);
- **doctor ms**: :func:`raydeep.doctor.network.links_seconds` with the measured latency and
  bandwidth (inside and between the declared nodes alike: it is all loopback here);
- **blocked ms**: the time the ranks spent in collectives (the mean over ranks; min-max in
  brackets). It includes waiting for a slower rank's compute, which no traffic model sees: with
  more ranks than cores the ranks take turns on the CPUs;
- **codec ms**: the doctor's (de)quantization time at the rate measured here on one thread. The
  engine quantizes outside its collectives, so this is in the step's time, not in blocked;
- **step ms**: the median wall time of a step (the slowest rank's, from a barrier).

``--reuse 0`` (``stage3_max_reuse_distance``) makes the small model re-gather every block for
backward, as a large one does at the default distance. Without ``--overlap`` every collective is
synchronous (``stage3_prefetch_bucket_size`` 0, ``overlap_comm`` false), so the blocked time is
each collective's whole time, as the doctor's sum assumes; with it (DeepSpeed's defaults) a gather
or reduce-scatter hidden behind compute is blocked only for what is left of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

CASES = {
    "ZeRO-3": {},
    "hpZ": {"zero_hpz_partition_size": "per_node"},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ + qwZ + qgZ": {"zero_hpz_partition_size": "per_node", "zero_quantized_weights": True,
                        "zero_quantized_gradients": True},
}


def ds_config(opts, case: str) -> dict:
    zero = {"stage": 3, "stage3_max_reuse_distance": opts.reuse, "overlap_comm": opts.overlap,
            "stage3_prefetch_bucket_size": 50_000_000 if opts.overlap else 0,
            # the blocks' matrices are partitioned, their biases and norms stay gathered, as in a
            # large model under the default threshold (this model's largest tensor is below it)
            "stage3_param_persistence_threshold": 1000}
    zero.update({k: opts.per_node if v == "per_node" else v for k, v in CASES[case].items()})
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero, "raydeep": {"check_collective_order": opts.aligned}}


def build_model(opts):
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    return build_gpt(opts.model, block_size=opts.seq)


def _timed(fn, reps: int) -> float:
    """The median seconds of ``fn``, each time after a few milliseconds of compute and a barrier:
    a collective that follows compute, as in a step, costs more than one issued in a tight loop
    (gloo's threads and the caches have gone cold: about 0.6 ms against 0.3 ms here)."""
    import torch.distributed as dist

    took, a = [], torch.randn(256, 256)
    for _ in range(reps):
        for _ in range(20):
            a = torch.tanh(a @ a.T * 0.01)
        dist.barrier()
        began = time.perf_counter()
        fn()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def measure_links(per_node: int, reps: int = 30) -> tuple[float, float, float | None]:
    """(latency seconds across all ranks, bytes per second each rank sends, latency seconds inside
    a declared node, or None with one rank a node) of raydeep's all-gather."""
    import torch.distributed as dist

    from raydeep import comm

    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = [dist.new_group(list(range(n, n + per_node))) for n in range(0, world, per_node)]  # every rank makes each
    small, big = torch.zeros(8), torch.randn(1 << 19)  # 32 bytes; 2 MB per rank
    small_out, big_out = torch.empty(world * small.numel()), torch.empty(world * big.numel())
    latency = _timed(lambda: comm.all_gather(small_out, small), reps)
    moved = _timed(lambda: comm.all_gather(big_out, big), max(5, reps // 5))
    sent = (world - 1) / world * big_out.numel() * big_out.element_size()
    inside = None
    if per_node > 1:
        node_out = torch.empty(per_node * small.numel())
        inside = _timed(lambda: comm.all_gather(node_out, small, group=nodes[rank // per_node]), reps)
    return latency, sent / max(moved - latency, 1e-9), inside


def measure(opts) -> dict:
    """On every rank: the links, then each case's counted collectives and times."""
    import torch.distributed as dist

    import raydeep

    os.environ["LOCAL_WORLD_SIZE"] = str(opts.per_node)  # the declared nodes ZeRO++'s groups follow
    rank, world = dist.get_rank(), dist.get_world_size()
    latency, bandwidth, inside = measure_links(opts.per_node)
    vocab = build_model(opts).config.vocab_size
    out = {"latency": latency, "bandwidth": bandwidth, "intra_node_latency": inside, "cases": {}}
    for case in CASES:
        engine, *_ = raydeep.initialize(model=build_model(opts), config=ds_config(opts, case))
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        g = torch.Generator().manual_seed(1)
        walls = []
        for step in range(1 + opts.steps):
            data = torch.randint(0, vocab, (micro * gas * world, opts.seq + 1), generator=g)
            if step == 1:  # the first step records stage 3's trace
                engine.reset_comm_stats()
            dist.barrier()
            began = time.perf_counter()
            for k in range(gas):
                x = data[(k * world + rank) * micro:][:micro]
                engine.backward(engine(x[:, :-1], x[:, 1:]))
                engine.step()
            walls.append(time.perf_counter() - began)
        ops = {op: {k: v / opts.steps for k, v in s.items()} for op, s in engine.comm_stats().items()}
        out["cases"][case] = {"ops": ops, "walls": walls[1:]}
        engine.destroy()
    return out


def predict(opts, case: str, latency: float, bandwidth: float, rates, inside: float | None = None) -> dict:
    from raydeep.config import load_config
    from raydeep.doctor.network import latency_seconds, links_seconds
    from raydeep.doctor.shape import ModelShape
    from raydeep.doctor.traffic import predict_traffic

    cfg = load_config(ds_config(opts, case), world_size=opts.world)
    traffic = predict_traffic(cfg, ModelShape.from_module(build_model(opts), opts.seq), opts.per_node)
    return {"collectives": sum(traffic.calls_by_op.values()), "bytes": traffic.total,
            "comm_s": links_seconds(traffic, bandwidth, bandwidth, latency, inside),
            "moved_s": links_seconds(traffic, bandwidth, bandwidth, 0.0),
            "latency_s": latency_seconds(traffic, latency, inside), "codec_s": rates.seconds(traffic.codec_passes)}


def run(opts) -> dict:
    from raydeep.bench.ranks import on_gloo_ranks
    from raydeep.doctor.network import measure_codec_rates

    per_rank = on_gloo_ranks(opts.world, measure, (opts,), threads=1)
    latency = statistics.median(r["latency"] for r in per_rank)
    bandwidth = min(r["bandwidth"] for r in per_rank)
    inside = None if opts.per_node == 1 else statistics.median(r["intra_node_latency"] for r in per_rank)
    torch.set_num_threads(1)  # as each rank ran
    rates = measure_codec_rates(numel=1 << 18)
    rows = []
    for case in CASES:
        counted = [r["cases"][case] for r in per_rank]
        blocked = [sum(s["blocked_s"] for s in c["ops"].values()) for c in counted]
        if not rows:  # the first case (ZeRO-3) calibrates the latency a collective has inside a step
            plain = predict(opts, case, latency, bandwidth, rates)
            step_latency = max(0.0, statistics.mean(blocked) - plain["moved_s"]) / plain["collectives"]
        steps = [max(c["walls"][s] for c in counted) for s in range(opts.steps)]  # the slowest rank's
        predicted = predict(opts, case, latency, bandwidth, rates, inside)
        # both latencies scaled by what a step's collectives cost against the measured ones
        predicted["calibrated_s"] = predicted["moved_s"] + predicted["latency_s"] * step_latency / latency
        rows.append({"case": case, "predicted": predicted,
                     "collectives": sum(s["calls"] for s in counted[0]["ops"].values()),
                     "bytes": sum(s["bytes"] for s in counted[0]["ops"].values()),
                     "blocked_s": statistics.mean(blocked), "blocked_min_s": min(blocked),
                     "blocked_max_s": max(blocked), "step_s": statistics.median(steps)})
    return {"setup": {k: v for k, v in vars(opts).items() if k != "json"}, "latency_s": latency,
            "intra_node_latency_s": inside,
            "step_latency_s": step_latency,
            "bandwidth_bytes_s": bandwidth, "codec": rates.source, "rows": rows,
            "load_average": os.getloadavg()[0]}


def render(result: dict) -> str:
    s = result["setup"]
    lines = [f"{s['model']} (seq {s['seq']}), {s['world']} gloo ranks as {s['world'] // s['per_node']} nodes x "
             f"{s['per_node']}, bf16, stage3_max_reuse_distance {s['reuse']}, prefetch and overlap_comm "
             f"{'on' if s['overlap'] else 'off'}, {'ranks aligned before each collective, ' if s['aligned'] else ''}"
             f"{s['steps']} steps; loopback links "
             f"measured: latency {result['latency_s'] * 1e3:.2f} ms a collective"
             + ("" if result["intra_node_latency_s"] is None else
                f" ({result['intra_node_latency_s'] * 1e3:.2f} ms inside a node)")
             + f", {result['bandwidth_bytes_s'] / 1e9:.2f} GB/s sent per rank; load {result['load_average']:.1f}",
             f"{'case':<17}{'collectives':>16}{'bytes':>22}{'doctor ms':>11}{'calibrated':>12}{'blocked ms':>22}"
             f"{'doctor/blocked':>16}{'calibrated/blocked':>20}{'codec ms':>10}{'step ms':>9}"]
    for r in result["rows"]:
        p = r["predicted"]
        lines.append(f"{r['case']:<17}{p['collectives']:>8} / {r['collectives']:<5g}{p['bytes']:>11,} / {r['bytes']:<9,.0f}"
                     f"{p['comm_s'] * 1e3:>11.1f}{p['calibrated_s'] * 1e3:>12.1f}{r['blocked_s'] * 1e3:>9.1f} "
                     f"({r['blocked_min_s'] * 1e3:.0f}-{r['blocked_max_s'] * 1e3:.0f}){'':>3}"
                     f"{p['comm_s'] / r['blocked_s']:>13.2f}{p['calibrated_s'] / r['blocked_s']:>20.2f}"
                     f"{p['codec_s'] * 1e3:>10.1f}{r['step_s'] * 1e3:>9.0f}")
    lines.append("(collectives and bytes: the doctor's / counted by the engine, per step and rank; doctor ms: "
                 "latency x collectives + bytes / bandwidth, a collective inside a node at its own latency; calibrated: "
                 f"the latencies scaled to what a collective cost inside ZeRO-3's steps, {result['step_latency_s'] * 1e3:.2f}"
                 " ms: its blocked time less its bytes' time, per collective)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reuse", type=int, default=0, help="stage3_max_reuse_distance (default 0)")
    parser.add_argument("--overlap", action="store_true", help="prefetch and overlap_comm on (default: off, "
                        "every collective synchronous)")
    parser.add_argument("--aligned", action="store_true", help="line the ranks up before each collective over "
                        "all ranks (raydeep.check_collective_order), so its blocked time leaves out the wait for a "
                        "rank still computing")
    parser.add_argument("--json", help="write the result here too")
    opts = parser.parse_args(argv)
    if opts.world % opts.per_node:
        parser.error(f"--per-node {opts.per_node} must divide --world {opts.world}")
    result = run(opts)
    print(render(result))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
