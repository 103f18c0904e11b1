import sys, time, collections
import torch, psutil
from benchmarks import offload as ob
from raydeep.bench.ranks import on_gloo_ranks


def snap():
    out = collections.Counter()
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            t = p.cpu_times()
            cmd = " ".join(p.info["cmdline"] or [])[:80]
            name = p.info["name"] or ""
            if "OffloadActor" in cmd or "OffloadActor" in name:
                key = "actor"
            elif "raylet" in name or "raylet" in cmd:
                key = "raylet"
            elif "gcs_server" in name:
                key = "gcs"
            elif "multiprocessing" in cmd or "spawn_main" in cmd:
                key = "ranks"
            elif "ray::" in name or "ray::" in cmd:
                key = "ray-other:" + name[:30]
            else:
                key = "other"
            out[key] += t.user + t.system
        except Exception:
            pass
    return out, time.perf_counter()


def _rank(address, steps, model, micro_batch=4, seq=64):
    import ray, torch.distributed as dist, raydeep
    from raydeep.models import build_gpt
    rank = dist.get_rank()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    engines = {}
    for name, (target, delayed, lookahead) in ob.TIERS.items():
        torch.manual_seed(0)
        zero = {"stage": 2, "reduce_bucket_size": 200_000}
        if target:
            zero.update(offload_optimizer={"device": "cpu"})
        cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
               "raydeep": {"offload_target": target or "auto", "offload_actor_cpus": 0.5,
                           "delayed_update": delayed, "delayed_update_warmup_steps": 0,
                           "delayed_update_lookahead": lookahead}}
        engines[name], *_ = raydeep.initialize(model=build_gpt(model, block_size=seq), config=cfg)
    g = torch.Generator().manual_seed(rank)
    cpu = {n: collections.Counter() for n in ob.TIERS}
    wall = collections.Counter()
    nsteps = collections.Counter()
    fb = {n: [] for n in ob.TIERS}; st = {n: [] for n in ob.TIERS}
    for block in range(-(-steps // (ob.BLOCK - 1))):
        order = list(ob.TIERS)[block % len(ob.TIERS):] + list(ob.TIERS)[:block % len(ob.TIERS)]
        for name in order:
            for j in range(ob.BLOCK):
                if j == 1 and rank == 0 and block > 0:
                    s0, w0 = snap()
                x = torch.randint(0, 256, (micro_batch, seq + 1), generator=g)
                dist.barrier()
                engine = engines[name]
                t0 = time.perf_counter()
                engine.backward(engine(x[:, :-1], x[:, 1:]))
                t1 = time.perf_counter()
                engine.step()
                t2 = time.perf_counter()
                if j > 0 and block > 0:
                    fb[name].append(t1 - t0); st[name].append(t2 - t1)
            dist.barrier()
            if rank == 0 and block > 0:
                s1, w1 = snap()
                for k in s1:
                    cpu[name][k] += s1[k] - s0.get(k, 0)
                wall[name] += w1 - w0
                nsteps[name] += ob.BLOCK - 1
    for e in engines.values():
        e.destroy()
    ray.shutdown()
    import statistics as S
    ph = {n: (S.median(fb[n]), S.median(st[n])) for n in ob.TIERS}
    if rank == 0:
        return {n: ({k: v / nsteps[n] for k, v in cpu[n].items()}, wall[n] / nsteps[n], ph[n]) for n in ob.TIERS}
    print("rank1", {n: f"fb {a*1e3:.1f} step {b*1e3:.1f}" for n, (a, b) in ph.items()}, flush=True)
    return None


if __name__ == "__main__":
    import ray, os
    ray.init(num_cpus=4, resources={"raydeep_offload": 1}, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"RD_NICE": os.environ.get("RD_NICE", ""), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    addr = ray.get_runtime_context().gcs_address
    res = on_gloo_ranks(2, _rank, (addr, int(sys.argv[1]) if len(sys.argv) > 1 else 30, "gpt-small-cpu"), timeout=1800)[0]
    for n, (c, w, (a, b)) in res.items():
        tot = sum(c.values())
        print(f"{n:30s} fb {a*1e3:5.1f} step {b*1e3:5.1f} wall {w*1e3:6.1f} ms  cpu {tot*1e3:6.1f} ms  " + "  ".join(f"{k}={v*1e3:.1f}" for k, v in sorted(c.items()) if v > 0.0005))
    ray.shutdown()
