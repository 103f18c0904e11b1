"""How raydeep's cost grows with the work: against model size, and against world size.

    python -m benchmarks.scaling --out scaling/            # scaling.json, model_size.png, world_size.png

- **Model size** (real gloo ranks, ``--world``, default 2): the built-in GPT ``--model`` (default
  gpt-small-cpu) at ``--layers`` blocks (default 1, 2, 4, 8), raydeep stages 0-3 taking turns one optimizer step at a
  time; per size and stage the median step time, the bytes each rank moved per step and its
  model-state bytes.
- **World size** 1-``--max-world`` (default 8): the engine's own layout and traffic at sizes this
  machine cannot run, from one process in torch's ``fake`` process group (the collectives do
  nothing, but raydeep partitions, counts and reports exactly as on a real group): rank 0's
  model-state bytes and bytes per step, for every stage. Real gloo runs at ``--real-worlds``
  (default 1, 2, 4) check them: the same numbers, or the script says where they differ.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback

import torch

from raydeep.bench.engines import model_state_bytes
from raydeep.bench.ranks import on_gloo_ranks
from raydeep.bench.run import batches

STAGES = (0, 1, 2, 3)
VOCAB = 256  # token ids drawn below every built-in size's vocabulary


def _config(stage: int, micro: int, gas: int, bucket: int) -> dict:
    from raydeep.bench.engines import ds_config

    return ds_config(micro, gas, stage, bucket, overlap=None)


def _model(name: str, n_layer: int, seq: int):
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    return build_gpt(name, block_size=seq, **({"n_layer": n_layer} if n_layer else {}))


def _engine_numbers(engine) -> tuple[int, int]:
    """(model-state bytes this rank holds, bytes it moved so far)."""
    return model_state_bytes(engine), sum(op["bytes"] for op in engine.comm_stats().values())


def _train_step(engine, micro_batches) -> None:
    for x, y in micro_batches:
        engine.backward(engine(x, y))
        engine.step()


# --- in a rank ------------------------------------------------------------------------------------
def model_size_rank(opts) -> dict:
    """Every layer count: the four stages round robin; step times, bytes per step, states."""
    import torch.distributed as dist

    import raydeep

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for n_layer in opts.layers:
        engines = [raydeep.initialize(model=_model(opts.model, n_layer, opts.seq), config=_config(s, opts.micro, opts.gas,
                                                                                       opts.bucket))[0]
                   for s in STAGES]
        times = [[] for _ in STAGES]
        data = batches(opts.micro, opts.gas, opts.seq, rank, world, opts.warmup + opts.steps, VOCAB)
        moved_before = [0] * len(STAGES)
        for step, micro in enumerate(data):
            if step == opts.warmup:
                moved_before = [_engine_numbers(e)[1] for e in engines]
            for i in [(step + k) % len(STAGES) for k in range(len(STAGES))]:
                dist.barrier()
                start = time.perf_counter()
                _train_step(engines[i], micro)
                if step >= opts.warmup:
                    times[i].append(time.perf_counter() - start)
        params = sum(p.numel() for p in _model(opts.model, n_layer, opts.seq).parameters())
        out[n_layer] = {"params": params, "stages": {}}
        for i, (stage, engine) in enumerate(zip(STAGES, engines)):
            states, moved = _engine_numbers(engine)
            out[n_layer]["stages"][stage] = {"times": times[i], "states": states,
                                             "bytes_per_step": (moved - moved_before[i]) / opts.steps}
            engine.destroy()
    return out


def layout_rank(opts) -> dict:
    """Two optimizer steps at every stage: this rank's model-state bytes and the bytes of the second step."""
    import raydeep

    out = {}
    for stage in STAGES:
        engine, *_ = raydeep.initialize(model=_model(opts.model, opts.layout_layers, opts.seq),
                                        config=_config(stage, opts.micro, opts.gas, opts.bucket))
        world = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
        first, second = batches(opts.micro, opts.gas, opts.seq, rank, world, 2, VOCAB)
        _train_step(engine, first)  # the first step also gathers what stage 3 then keeps
        _, before = _engine_numbers(engine)
        _train_step(engine, second)
        states, after = _engine_numbers(engine)
        out[stage] = {"states": states, "bytes_per_step": after - before}
        engine.destroy()
    return out


def fake_layouts(opts) -> dict:
    """``layout_rank`` as rank 0 of a fake group of every world size, one group after another in
    one child process (a benchmark's process keeps no group of its own)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fake_main, args=(opts, queue))
    proc.start()
    error, payload = queue.get(timeout=opts.timeout)
    proc.join(timeout=30)
    if error:
        raise RuntimeError(f"the fake-group layouts failed:\n{error}")
    return payload


def _fake_main(opts, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.set_num_threads(1)
        out = {}
        for world in range(1, opts.max_world + 1):
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            out[world] = layout_rank(opts)
            dist.destroy_process_group()
        queue.put((None, out))
    except BaseException:
        queue.put((traceback.format_exc(), None))


# --- the whole ------------------------------------------------------------------------------------
def run(opts) -> dict:
    load = os.getloadavg()[0]
    ranks = on_gloo_ranks(opts.world, model_size_rank, (opts,), timeout=opts.timeout) if opts.layers else []
    model_size = []
    for n_layer in opts.layers:
        for stage in STAGES:
            steps = [max(r[n_layer]["stages"][stage]["times"][s] for r in ranks) for s in range(opts.steps)]
            entry = ranks[0][n_layer]["stages"][stage]
            model_size.append({"n_layer": n_layer, "params": ranks[0][n_layer]["params"], "stage": stage,
                               "median_s": statistics.median(steps), "bytes_per_step": entry["bytes_per_step"],
                               "states_per_rank": max(r[n_layer]["stages"][stage]["states"] for r in ranks)})
    fake = fake_layouts(opts)
    real = {world: on_gloo_ranks(world, layout_rank, (opts,), timeout=opts.timeout)[0] for world in opts.real_worlds}
    checks = []
    for world, stages in real.items():
        for stage, numbers in stages.items():
            checks.append({"world": world, "stage": stage, "real": numbers, "fake": fake[world][stage],
                           "equal": numbers == fake[world][stage]})
    return {"setup": {k: v for k, v in vars(opts).items() if k != "out"}, "load_average": [load, os.getloadavg()[0]],
            "model_size": model_size, "world_size": {w: fake[w] for w in fake}, "checks": checks}


def plots(summary: dict, out: str) -> dict:
    """Writes model_size.png (when the summary has that part) and world_size.png; returns their
    (closed) matplotlib Figures by name, whose artists say what each PNG shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    if summary["model_size"]:
        figures["model_size"] = _model_size_plot(plt, summary, out)
    figures["world_size"] = _world_size_plot(plt, summary, out)
    return figures


def _model_size_plot(plt, summary: dict, out: str):
    s = summary["setup"]
    fig, (t_ax, b_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for stage in STAGES:
        rows = [r for r in summary["model_size"] if r["stage"] == stage]
        params = [r["params"] / 1e6 for r in rows]
        t_ax.plot(params, [1e3 * r["median_s"] for r in rows], marker="o", label=f"z{stage}")
        b_ax.plot(params, [r["bytes_per_step"] / 1e6 for r in rows], marker="o", label=f"z{stage}")
    for ax, label in ((t_ax, "median ms per optimizer step"), (b_ax, "MB each rank moved per step")):
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(title="ZeRO stage")
    fig.suptitle(f"raydeep against model size: {s['model']} with {', '.join(map(str, s['layers']))} blocks, "
                 f"{s['world']} gloo ranks, micro {s['micro']} x seq {s['seq']}, GAS {s['gas']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "model_size.png"), dpi=110)
    plt.close(fig)
    return fig


def _world_size_plot(plt, summary: dict, out: str):
    s = summary["setup"]
    fig, (m_ax, b_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    worlds = sorted(summary["world_size"])
    for stage in STAGES:
        m_ax.plot(worlds, [summary["world_size"][w][stage]["states"] / 1e6 for w in worlds], marker=".",
                  label=f"z{stage}")
        b_ax.plot(worlds, [summary["world_size"][w][stage]["bytes_per_step"] / 1e6 for w in worlds], marker=".",
                  label=f"z{stage}")
    for check in summary["checks"]:
        for ax, key in ((m_ax, "states"), (b_ax, "bytes_per_step")):
            ax.scatter([check["world"]], [check["real"][key] / 1e6], s=80, facecolors="none", edgecolors="black",
                       zorder=3)
    m_ax.set_ylabel("model-state MB per rank")
    b_ax.set_ylabel("MB each rank moved per step")
    for ax in (m_ax, b_ax):
        ax.set_xlabel("world size")
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
        # Below the axes: inside, a legend would cover one of the curves.
        ax.legend(title="ZeRO stage (circles: real gloo runs)", loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  ncol=4)
    blocks = s["layout_layers"] or "its own"
    fig.suptitle(f"raydeep against world size: {s['model']} ({blocks} blocks), the engine's layout in a fake "
                 f"process group")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "world_size.png"), dpi=110, bbox_inches="tight")  # with the legends below
    plt.close(fig)
    return fig


def render(summary: dict) -> str:
    lines = [f"load average {summary['load_average'][0]:.1f} -> {summary['load_average'][1]:.1f}",
             f"{'blocks':>6}{'params':>10}{'stage':>6}{'median ms':>11}{'MB/step':>9}{'states MB':>10}"]
    for r in summary["model_size"]:
        lines.append(f"{r['n_layer']:>6}{r['params'] / 1e6:>9.2f}M{r['stage']:>6}{1e3 * r['median_s']:>11.1f}"
                     f"{r['bytes_per_step'] / 1e6:>9.2f}{r['states_per_rank'] / 1e6:>10.2f}")
    lines.append(f"{'world':>6}" + "".join(f"{f'z{s} states MB':>14}{f'z{s} MB/step':>12}" for s in STAGES))
    for w, stages in sorted(summary["world_size"].items()):
        lines.append(f"{w:>6}" + "".join(f"{stages[s]['states'] / 1e6:>14.3f}{stages[s]['bytes_per_step'] / 1e6:>12.3f}"
                                         for s in STAGES))
    for c in summary["checks"]:
        verdict = "equal" if c["equal"] else f"DIFFERENT: real {c['real']}, fake {c['fake']}"
        lines.append(f"real gloo world {c['world']} stage {c['stage']}: {verdict}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-small-cpu", help="a size from raydeep.models.GPT_SIZES")
    parser.add_argument("--layers", type=lambda t: [int(x) for x in t.split(",") if x], default=[1, 2, 4, 8],
                        help="block counts of the model-size part ('': skip it)")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks for the model-size runs")
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--real-worlds", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4])
    parser.add_argument("--layout-layers", type=int, default=0,
                        help="blocks of the model of the world-size part (0: the size's own)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="scaling")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    opts = parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    summary = run(opts)
    print(render(summary))
    with open(os.path.join(opts.out, "scaling.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    plots(summary, opts.out)
    return summary


if __name__ == "__main__":
    main()
