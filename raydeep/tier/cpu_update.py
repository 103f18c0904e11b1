"""The offloaded CPU update in one pass over memory: a small C++ extension (``csrc/fused_adam.cpp``).

Why: the update otherwise reads and writes its 8M-element sub-groups four times (widen the
gradient to fp32, scale it, torch's fused Adam/AdamW, narrow the master into the parameter); it is
memory-bound, so one pass runs about twice as fast. It computes the same bits as those four
passes: before first use it is checked against torch's kernel on the running CPU.

It is built on first use with ``torch.utils.cpp_extension`` (cached in torch's extension dir; the
name carries a hash of the source, so an edit rebuilds), for the CPU capability torch dispatches
to (``torch.backends.cpu.get_cpu_capability()``); the build's library path is recorded under
``$XDG_CACHE_HOME/raydeep/cpu_update/`` (``~/.cache``), and later processes load it from there
without importing torch's builder. Where it cannot be built or does not match
torch, ``available()`` is False after one warning and ``fused_adam_step`` runs the four passes.
``RAYDEEP_CPU_UPDATE=torch`` forces that fallback (no warning).

    python -m raydeep.tier.cpu_update --build    # build now; prints where it is, or why not
    python -m raydeep.tier.cpu_update --bench    # elements/s against torch's fused AdamW, 1 thread
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import statistics
import threading
import time
import warnings

import torch

ENV = "RAYDEEP_CPU_UPDATE"  # "torch": always the fallback
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fused_adam.cpp")
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
                 "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
# As torch compiles its kernels for each capability (cmake/Codegen.cmake), so the vector types match.
_CAPABILITY_FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
_warned = False


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _build_spec() -> tuple[str, list[str]] | str:
    """(extension name, compiler flags) for this machine, or why there is none."""
    cap = _capability()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"built for x86-64 only (this is {platform.machine()})"
    if cap not in _CAPABILITY_FLAGS:
        return f"no variant for torch's CPU capability {cap!r}"
    try:
        with open(_SOURCE, "rb") as f:
            source = f.read()
    except OSError as exc:
        return f"its source is missing ({exc})"
    flags = _COMMON_FLAGS + _CAPABILITY_FLAGS[cap] + [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
    digest = hashlib.sha256(source + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"raydeep_fused_adam_{cap.lower()}_{digest}"
    return name, flags + [f"-DRAYDEEP_OPS_NS={name}"]


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    """(the extension's ops, its library path), or (None, why not). Builds on first call."""
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return None, f"{ENV}=torch"
    spec = _build_spec()
    if isinstance(spec, str):
        return None, spec
    name, flags = spec
    path = _load_built(name)
    try:
        if path is None:
            from torch.utils import cpp_extension
            clear_stale_lock(_build_directory(cpp_extension, name))
            path = cpp_extension.load(name, [_SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                      is_python_module=False, verbose=False)
            _remember_built(name, str(path))
        ops = getattr(torch.ops, name)
    except Exception as exc:  # no compiler, no headers, no ninja, a compile error
        return None, f"the build failed: {_short(exc)}"
    mismatch = _self_check(ops.fused_adam_step)
    if mismatch:
        return None, mismatch
    return ops, str(path)


# Where each build's library is, by extension name: a process that finds its library there loads
# it without importing torch.utils.cpp_extension, which imports setuptools (0.1-0.3 s, paid on the
# first step of every new worker process, so on every restart's path). The name is a hash of the
# source, the flags and torch's version, so a recorded library is the one a build would produce.
_BUILT_INDEX = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "raydeep", "cpu_update")


def _load_built(name: str) -> str | None:
    """Load the library a build recorded for ``name``; its path, or None (never recorded, gone,
    being rebuilt, or not loadable: the caller builds as usual)."""
    try:
        with open(os.path.join(_BUILT_INDEX, name)) as f:
            path = f.read().strip()
        if os.path.exists(os.path.join(os.path.dirname(path), "lock")):
            return None  # a build is writing it now: wait for that build the usual way
        torch.ops.load_library(path)
    except (OSError, RuntimeError):
        return None
    return path


def _remember_built(name: str, path: str) -> None:
    try:
        os.makedirs(_BUILT_INDEX, exist_ok=True)
        partial = os.path.join(_BUILT_INDEX, f".{name}.{os.getpid()}")
        with open(partial, "w") as f:
            f.write(path)
        os.replace(partial, os.path.join(_BUILT_INDEX, name))  # whole or absent for a reader
    except OSError:
        pass  # a read-only home: each process goes through torch's builder, as before


def _build_directory(cpp_extension, name: str) -> str:
    try:
        return cpp_extension._get_build_directory(name, False)
    except AttributeError:  # a torch without the helper: its default layout
        return os.path.join(cpp_extension.get_default_build_root(), name)


STALE_LOCK_S = 300.0  # a build of this one file takes under a minute, a few on a loaded machine


def clear_stale_lock(build_dir: str, stale_after: float = STALE_LOCK_S, poll: float = 1.0) -> bool:
    """Remove the build lock a killed build left behind; True if one was removed.

    torch's extension builder waits, without a limit, for the ``lock`` file of a build in progress
    to go away; a build killed mid-way (a Ctrl-C, an OOM kill) leaves it forever, and every later
    process would hang on it. A lock younger than ``stale_after`` seconds is another process's
    build: wait for it (polling) until it finishes or grows stale."""
    lock = os.path.join(build_dir, "lock")
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return False  # no lock: nobody is building
        if age >= stale_after:
            break
        time.sleep(min(poll, stale_after - age))
    try:
        os.remove(lock)
    except OSError:
        return False  # its build finished, or another process removed it first
    warnings.warn(f"raydeep: removed the fused CPU update's build lock {lock}, left {age:.0f} s ago by a build "
                  "that did not finish; building again", stacklevel=2)
    return True


def _short(exc: BaseException) -> str:
    """The compiler's own complaint, without ninja's command lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not (line.startswith(("[", "FAILED:", "ninja:")) or " -o " in line)]
    errors = [line for line in said if any(w in line.lower() for w in ("error", "not found", "no such file"))]
    text = "; ".join((errors or said or lines)[:3]) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


def available() -> bool:
    """Whether ``fused_adam_step`` runs the extension (else torch's four passes). The first call
    builds it; where that fails it warns once, naming the reason."""
    global _warned
    ops, why = _load()
    if ops is None and not _warned and why != f"{ENV}=torch":
        _warned = True
        warnings.warn(f"raydeep: the fused CPU update is unavailable ({why}); the offloaded update falls back "
                      "to torch's fused AdamW, which is slower", RuntimeWarning, stacklevel=2)
    return ops is not None


def status() -> str:
    """The extension's path, or why it is unavailable."""
    return _load()[1]


def fused_adam_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    grad: torch.Tensor, out: torch.Tensor | None, *, scale: float, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, step: float, decoupled: bool,
                    maximize: bool = False, threads: int | None = None,
                    lookahead: tuple[torch.Tensor, torch.Tensor, tuple[float, ...]] | None = None) -> None:
    """One Adam (``decoupled=False``) or AdamW step in place, on contiguous CPU tensors: ``master``,
    ``exp_avg``, ``exp_avg_sq`` fp32; ``grad`` bf16, fp16 or fp32, multiplied by ``scale``; ``out``
    (bf16, fp16, fp32 or None) receives the updated master. ``step`` is the step count after its
    increment (torch's ``state["step"]``). ``threads``: how many to use (None: torch's setting).
    ``lookahead``: ``(base, rate, constants)`` (like ``out``, which it needs;
    ``raydeep.tier.lookahead.constants``) also receive the delayed update's lookahead terms.

    Bitwise what raydeep did in four passes: ``buf = grad.to(fp32); buf.mul_(scale)`` (when scale is
    not 1), torch's fused Adam/AdamW with ``buf`` as the gradient, ``out.copy_(master)``."""
    base, rate, terms = lookahead if lookahead is not None else (None, None, ())
    if available():
        ops, _ = _load()
        ops.fused_adam_step(master.detach(), exp_avg.detach(), exp_avg_sq.detach(), grad.detach(),
                            None if out is None else out.detach(), float(scale), float(lr), float(beta1),
                            float(beta2), float(eps), float(weight_decay), float(step), bool(decoupled),
                            bool(maximize), int(threads or 0), base, rate, [float(c) for c in terms])
        return
    _torch_step(master, exp_avg, exp_avg_sq, grad, out, scale=scale, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=step, decoupled=decoupled, maximize=maximize, threads=threads)
    if lookahead is not None:
        from raydeep.tier.lookahead import write_terms
        write_terms(master.detach().reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1), base.reshape(-1),
                    rate.reshape(-1), terms, decoupled)


_local = threading.local()  # the fallback's fp32 gradient buffer, reused: fresh pages cost more than the update


def _torch_step(master, exp_avg, exp_avg_sq, grad, out, *, scale, lr, beta1, beta2, eps, weight_decay, step,
                decoupled, maximize=False, threads=None) -> None:
    """The four passes, with torch's own kernels (the fallback and the reference)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            held = getattr(_local, "buffer", None)
            if held is None or held.numel() < grad.numel():
                held = _local.buffer = torch.empty(grad.numel(), dtype=torch.float32)
            buf = held[:grad.numel()].view(grad.shape).copy_(grad)
            if scale != 1.0:
                buf.mul_(scale)
            fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
            fused([master.detach()], [buf], [exp_avg.detach()], [exp_avg_sq.detach()], [],
                  [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                  eps=eps, amsgrad=False, maximize=maximize)
            if out is not None:
                out.detach().copy_(master)
    finally:
        if threads:
            torch.set_num_threads(previous)


def _self_check(op) -> str:
    """'' when the extension computes torch's bits here, else what differs. Sizes cover every kind
    of tail (AVX-512: 15 = 8 + 7, 8, 7; AVX2: 7, 0), both modes, both weight-decay paths, with the
    delayed update's lookahead terms."""
    from raydeep.tier.lookahead import constants, write_terms

    gen = torch.Generator().manual_seed(0)
    cases = [(95, torch.bfloat16, True, 0.1, 0.37, False), (40, torch.float16, False, 0.1, 0.37, True),
             (7, torch.float32, False, 0.0, 2.0 ** -16, False), (71, torch.float32, True, 0.0, 1.0, False)]
    for n, dtype, decoupled, wd, scale, maximize in cases:
        master = torch.randn(n, generator=gen)
        states = [torch.zeros(n), torch.zeros(n)]
        mine = [master.clone(), *(s.clone() for s in states), *(torch.empty(n, dtype=dtype) for _ in range(3))]
        ref = [master.clone(), *(s.clone() for s in states), *(torch.empty(n, dtype=dtype) for _ in range(3))]
        for step in (1, 2):
            grad = (torch.randn(n, generator=gen) * 1e-2).to(dtype)
            hyper = dict(scale=scale, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                         step=float(step))
            terms = constants({"lr": 1e-3, "eps": 1e-8, "weight_decay": wd, "betas": (0.9, 0.999),
                               "maximize": maximize}, float(step), decoupled)
            op(*mine[:3], grad, mine[3], *hyper.values(), decoupled, maximize, 1, *mine[4:], list(terms))
            _torch_step(*ref[:3], grad, ref[3], **hyper, decoupled=decoupled, maximize=maximize)
            write_terms(*ref[:3], *ref[4:], terms, decoupled)
            for what, a, b in zip(("master", "exp_avg", "exp_avg_sq", "out", "lookahead base", "lookahead rate"),
                                  mine, ref):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    return (f"its {what} differs from torch's fused {'AdamW' if decoupled else 'Adam'} on this CPU "
                            f"(capability {_capability()}, torch {torch.__version__})")
    return ""


# --- the micro-benchmark -------------------------------------------------------------------------
def benchmark(n: int = 8 * 1024 * 1024, reps: int = 7, threads: int = 1) -> dict:
    """Elements/s of the fused pass (bf16 gradient in, bf16 parameter out) against torch's fused
    AdamW alone on fp32 tensors of the same size, and against the four passes it replaces,
    interleaved; medians of ``reps``."""
    if not available():
        raise RuntimeError(f"the fused CPU update is unavailable: {status()}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        grad = (torch.randn(n) * 1e-2).to(torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16)
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        master4, m4, v4, out4 = master.clone(), m.clone(), v.clone(), out.clone()
        hyper = dict(scale=0.37, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                     threads=threads)
        fused_t, torch_t, four_t = [], [], []
        for step in range(1, reps + 2):  # the first round warms up
            t0 = time.perf_counter()
            fused_adam_step(master, m, v, grad, out, step=step, **hyper)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            _torch_step(master4, m4, v4, grad, out4, step=step, **hyper)
            t3 = time.perf_counter()
            if step > 1:
                fused_t.append(t1 - t0)
                torch_t.append(t2 - t1)
                four_t.append(t3 - t2)
        fused_eps, torch_eps = n / statistics.median(fused_t), n / statistics.median(torch_t)
        four_eps = n / statistics.median(four_t)
        return {"elements": n, "threads": threads, "capability": _capability(),
                "fused_elements_per_s": fused_eps, "torch_fused_adamw_elements_per_s": torch_eps,
                "four_passes_elements_per_s": four_eps, "ratio": fused_eps / torch_eps,
                "four_passes_ratio": four_eps / torch_eps}
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raydeep.tier.cpu_update", description=__doc__.split("\n")[0])
    parser.add_argument("--build", action="store_true", help="build the extension and say where it is or why not")
    parser.add_argument("--bench", action="store_true", help="elements/s against torch's fused AdamW")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.build or not args.bench:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ok = available()
        took = time.perf_counter() - t0
        if ok:
            print(f"raydeep fused CPU update: {status()} (capability {_capability()}, {took:.1f} s)")
        else:
            print(f"raydeep fused CPU update: not built ({status()}); the offloaded update uses torch's "
                  "fused AdamW (slower)")
    if args.bench:
        r = benchmark(threads=args.threads)
        print(f"fused pass (bf16 grad -> bf16 param): {r['fused_elements_per_s'] / 1e6:.0f} M elements/s; "
              f"torch fused AdamW (fp32): {r['torch_fused_adamw_elements_per_s'] / 1e6:.0f} M elements/s; "
              f"ratio {r['ratio']:.2f}x (the four passes it replaces: {r['four_passes_ratio']:.2f}x; "
              f"{r['elements']} elements, {r['threads']} thread(s), {r['capability']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
