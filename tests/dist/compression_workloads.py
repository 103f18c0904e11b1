"""Workloads of the compressed-communication tests, run on gloo ranks."""
from __future__ import annotations

import torch

SIZES = (1000, 37, 4096)  # chunk sizes: none a multiple of every padding unit


def dyadic_grads(step: int, rank: int, params=None) -> list[torch.Tensor]:
    """Gradients that are multiples of 1/64 in [-1, 1]: any sum of a few of them, in any order,
    and that sum times 1/world are exact, so the ranks' all-reduce and the reference's rank-order
    sum agree to the bit whatever order the backend adds in."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-64, 65, (n,), generator=g).float() / 64 for n in SIZES]


def initial_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g) for n in SIZES]


def run_optimizer(name: str, options: dict, steps: int, split: list[list[int]] | None = None,
                  groups: list[dict] | None = None) -> dict:
    """The distributed optimizer over ``initial_params`` on this rank, fed ``dyadic_grads`` as the
    engine would: all-reduced and averaged unless the optimizer communicates itself.

    ``split``: step the parameters in several ``step()`` calls of one step (the optimizer tier's
    sub-groups), each call seeing only its parameters' gradients. ``groups``: one param group per
    parameter, with these extra options each (e.g. ``non_freeze``)."""
    import torch.distributed as dist

    from raydeep import comm
    from raydeep.compression import CompressedAllReduce, OnebitAdam, OnebitLamb, ZeroOneAdam

    rank, world = dist.get_rank(), dist.get_world_size()
    stats = comm.CommStats()
    params = [torch.nn.Parameter(p) for p in initial_params()]
    cls = {"onebitadam": OnebitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OnebitLamb}[name]
    param_groups = params if groups is None else [{"params": [p], **extra} for p, extra in zip(params, groups)]
    opt = cls(param_groups, communicator=CompressedAllReduce(stats), **options)
    split = split or [list(range(len(params)))]
    history, phases, step_bytes, step_calls = [], [], [], []
    for step in range(1, steps + 1):
        own = opt.communicates_gradients()
        phases.append(opt.phase)
        grads = dyadic_grads(step, rank)
        if not own:
            for g in grads:
                comm.all_reduce(g, stats)
                g.mul_(1.0 / world)
        before = stats.total_bytes
        calls = {k: v["calls"] for k, v in stats.summary().items()}
        with opt.one_phase():
            for indices in split:
                for i, (p, g) in enumerate(zip(params, grads)):
                    p.grad = g if i in indices else None
                opt.step()
        step_bytes.append(stats.total_bytes - before)
        step_calls.append({k: v["calls"] - calls.get(k, 0) for k, v in stats.summary().items()
                           if v["calls"] - calls.get(k, 0)})
        history.append([p.detach().clone() for p in params])
    return {"history": history, "phases": phases, "step_bytes": step_bytes, "step_calls": step_calls,
            "comm": stats.summary()}


# --- the engine on the tiny GPT ------------------------------------------------------------------
def gpt_config(optimizer: dict, gas: int = 1, micro: int = 2, clip: float = 0.0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "optimizer": optimizer, "zero_optimization": {"stage": 0, "reduce_bucket_size": 40000}, **extra}


class WireBytes:
    """Counts, independently of raydeep's CommStats, the bytes this rank sends through
    torch.distributed: a ring all-reduce sends 2(w-1)/w of the tensor, an all-to-all (w-1)/w of
    its input, an all-gather its input to each of the w-1 others, a point-to-point send its tensor
    (on gloo raydeep's all-gather is sends and receives: ``raydeep.comm.exchange``)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.sent, self._saved = dist, 0, {}
        world = dist.get_world_size()
        rules = {"all_reduce": lambda t, *a, **k: 2 * (world - 1) / world * _nbytes(t),
                 "all_to_all_single": lambda out, inp, *a, **k: (world - 1) / world * _nbytes(inp),
                 "all_gather_into_tensor": lambda out, inp, *a, **k: (world - 1) * _nbytes(inp),
                 "isend": lambda t, *a, **k: _nbytes(t)}
        if hasattr(dist, "all_gather_single"):
            rules["all_gather_single"] = rules["all_gather_into_tensor"]
        for name, rule in rules.items():
            self._wrap(name, rule)

    def _wrap(self, name, rule):
        import raydeep.comm as rcomm

        original = getattr(self.dist, name)

        def counted(*args, **kwargs):
            self.sent += rule(*args, **kwargs)
            return original(*args, **kwargs)
        self._saved[name] = original
        setattr(self.dist, name, counted)
        if getattr(rcomm, "_ALL_GATHER", None) is original:
            self._saved["_ALL_GATHER"] = original
            rcomm._ALL_GATHER = counted

    def close(self):
        import raydeep.comm as rcomm

        for name, original in self._saved.items():
            if name == "_ALL_GATHER":
                rcomm._ALL_GATHER = original
            else:
                setattr(self.dist, name, original)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _batch(step: int, rank: int, micro: int, k: int = 0, world: int = 1):
    from tests.dist.workloads import SEQ

    g = torch.Generator().manual_seed(10_000 + step)
    batch = torch.randint(0, 256, (micro * world * 8, SEQ + 1), generator=g)
    lo = (k * world + rank) * micro
    x = batch[lo:lo + micro]
    return x[:, :-1], x[:, 1:]


def engine_against_reference(optimizer: dict, steps: int, reference_options: dict) -> dict:
    """Train the tiny GPT with a compressed optimizer on this rank; rank 0 also runs the
    N-worker reference from the same start, computing each rank's gradients on a replica."""
    import torch.distributed as dist

    import raydeep
    from raydeep.compression import reference
    from tests.dist.workloads import tiny_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=gpt_config(optimizer))
    units = engine.strategy.units
    start = [u.local.detach().float().clone() for u in units]
    wire, history, step_bytes, phases = WireBytes(), [], [], []
    try:
        for step in range(1, steps + 1):
            phases.append(engine.tier.phase)
            before, logical = wire.sent, engine.comm_stats()
            engine.reset_comm_stats()
            x, y = _batch(step, rank, 2, world=world)
            engine.backward(engine(x, y))
            engine.step()
            step_bytes.append({"wire": wire.sent - before, "logical": engine.comm_stats()})
            history.append([u.local.detach().float().clone() for u in units])
            del logical
    finally:
        wire.close()
    out = {"history": history, "step_bytes": step_bytes, "phases": phases,
           "numel": sum(u.local.numel() for u in units)}
    if rank == 0:
        replica, slots = tiny_gpt(), [[(s.name, s.offset, s.numel) for s in u.layout.slots] for u in units]
        named = dict(replica.named_parameters())

        def grad_fn(step, r, flats):
            with torch.no_grad():
                for flat, unit_slots in zip(flats, slots):
                    for name, offset, n in unit_slots:
                        named[name].copy_(flat[offset:offset + n].view_as(named[name]))
            replica.zero_grad(set_to_none=True)
            x, y = _batch(step, r, 2, world=world)
            replica(x, y).backward()
            grads = []
            for flat, unit_slots in zip(flats, slots):
                g = torch.zeros_like(flat)
                for name, offset, n in unit_slots:
                    if named[name].grad is not None:
                        g[offset:offset + n] = named[name].grad.reshape(-1)
                grads.append(g)
            return grads
        simulate = {"OneBitAdam": reference.onebit_adam, "ZeroOneAdam": reference.zero_one_adam,
                    "OneBitLamb": reference.onebit_lamb}[optimizer["type"]]
        if optimizer["type"] == "OneBitLamb":  # each unit is one master; its parameters are the layers
            reference_options = {**reference_options,
                                 "layers": [[(name, offset, offset + n) for name, offset, n in s] for s in slots]}
        out["reference"] = simulate(start, grad_fn, steps, world, **reference_options)
    return out


def train_steps(engine, steps: int) -> list[float]:
    """``steps`` optimizer steps continuing from ``engine.global_steps``: step s reads batch s
    (so a resumed engine reads what an uninterrupted one would); losses averaged over ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for _ in range(steps):
        step, total = engine.global_steps + 1, 0.0
        for k in range(gas):
            x, y = _batch(step, rank, micro, k, world)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def reload_at_every_step(optimizer: dict, steps: int, path: str, save_at: list[int]) -> dict:
    """An uninterrupted run that saves a checkpoint after each step of ``save_at``; then, for
    each, a fresh engine loaded from it and continued to ``steps``. Returns, per save point, the
    phase it was saved in, the largest loss difference to the uninterrupted run and whether the
    final parameters are the same bits."""
    import raydeep
    from tests.dist.workloads import tiny_gpt

    cfg = gpt_config(optimizer, gas=2, clip=1.0)
    straight, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    expected, phases = [], {}
    for step in range(1, steps + 1):
        expected += train_steps(straight, 1)
        if step in save_at:
            phases[step] = describe_phase(straight.tier.optimizer)
            straight.save_checkpoint(path, tag=f"s{step}")
    out = {}
    for step in save_at:
        resumed, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
        resumed.load_checkpoint(path, tag=f"s{step}")
        got = train_steps(resumed, steps - step)
        out[step] = {"phase": phases[step], "worst": max(abs(a - b) for a, b in zip(got, expected[step:])),
                     "same_params": all(torch.equal(a.local, b.local) for a, b in
                                        zip(straight.strategy.units, resumed.strategy.units))}
        resumed.destroy()
    return out


def describe_phase(optimizer) -> str:
    """Which phase the next step is in, finer than ``phase`` for 0/1 Adam: ``local steps`` once
    the variance is frozen, ``between syncs`` when the ranks' local progress is not yet averaged."""
    if not hasattr(optimizer, "frozen") or not optimizer.frozen:
        return optimizer.phase
    pending = any(float(local["momentum_accumulator"].abs().sum()) > 0 for local in optimizer.rank_local.values()
                  if "momentum_accumulator" in local)
    return "between syncs" if pending else "local steps"


def load_at_another_world_size(optimizer: dict, path: str, tag: str, bucket: int = 40000) -> dict:
    """Load a checkpoint written at another world size (or with another ``reduce_bucket_size``):
    this rank's own state restarts, with one warning; training continues in the compressed stage."""
    import logging

    import raydeep
    from tests.dist.workloads import tiny_gpt

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("raydeep").addHandler(handler)
    try:
        cfg = gpt_config(optimizer, gas=2, clip=1.0)
        cfg["zero_optimization"]["reduce_bucket_size"] = bucket
        engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
        engine.load_checkpoint(path, tag=tag)
        lrs = [s["lrs"] for s in engine.tier.optimizer.state.values() if "lrs" in s]
        losses = train_steps(engine, 2)
    finally:
        logging.getLogger("raydeep").removeHandler(handler)
    return {"warnings": [r for r in records if "error feedback" in r], "phase": engine.tier.phase,
            "losses": losses, "lrs_after_load": max(lrs) if lrs else None,
            "errors": {k: float(v.abs().sum()) for k, v in engine.tier.rank_state().items()}}


def converge(optimizers: dict[str, dict], steps: int, micro: int, seed: int = 3) -> dict:
    """Train the tiny GPT on the built-in byte corpus with each optimizer from the same start and on
    the same batches (drawn with ``seed``); returns each run's per-step losses (averaged over
    ranks), its traffic, its element count and the optimizer the config built."""
    import torch.distributed as dist

    import raydeep
    from raydeep.data import builtin_dataset
    from tests.dist.workloads import SEQ, tiny_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    data = builtin_dataset(SEQ)
    out = {}
    for label, optimizer in optimizers.items():
        engine, *_ = raydeep.initialize(model=tiny_gpt(), config=gpt_config(optimizer, micro=micro, clip=1.0))
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, len(data), (micro * world,), generator=g)[rank * micro:(rank + 1) * micro]
            x = torch.stack([data[int(i)][0] for i in ids])
            y = torch.stack([data[int(i)][1] for i in ids])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            t = loss.detach().double().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / world)
        optimizer = engine.tier.shards.optimizer  # what the config built: the test checks it is the one meant
        out[label] = {"losses": losses, "phase": engine.tier.phase, "comm": engine.comm_stats(),
                      "numel": sum(u.local.numel() for u in engine.strategy.units),
                      "optimizer": type(optimizer).__name__,
                      "hyperparameters": {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}}
    return out
