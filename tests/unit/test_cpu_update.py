"""The fused CPU update (raydeep.tier.cpu_update) against the four passes it replaces, bit for bit.

The reference is the path raydeep ran before: ``buf = grad.to(fp32)``, ``buf.mul_(scale)`` (when
scale != 1), ``torch.optim.Adam/AdamW(fused=True).step()`` with ``buf`` as the gradient,
``out.copy_(master)``. Under CI=true a failed build fails here (it never skips silently). On a CPU
with AVX-512 the AVX2 and DEFAULT variants are checked too, in subprocesses
(``ATEN_CPU_CAPABILITY``), since CI may run on a CPU that dispatches to another capability.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from raydeep.tier import cpu_update

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (1, 7, 63, 64, 1000, 100_003)
GRAD_OUT = [(torch.bfloat16, True), (torch.float16, True), (torch.float32, True),
            (torch.bfloat16, False), (torch.float16, False), (torch.float32, False)]
SCALES = (1.0, 0.37, 1 / 65536)
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="module")
def built():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = cpu_update.available()
    if not ok:
        message = f"the fused CPU update extension is unavailable: {cpu_update.status()}"
        if _under_ci():
            pytest.fail(message + " (CI=true: a build that fails fails the suite)")
        pytest.skip(message)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


class Pair:
    """The same start, updated by the extension and by the four passes."""

    def __init__(self, n, grad_dtype, with_out, decoupled, wd, gen, beta1=BETAS[0], maximize=False, out_dtype=None):
        self.n, self.grad_dtype, self.decoupled, self.wd, self.gen = n, grad_dtype, decoupled, wd, gen
        self.beta1, self.maximize = beta1, maximize
        start = torch.randn(n, generator=gen)
        self.master, self.m, self.v = start.clone(), torch.zeros(n), torch.zeros(n)
        self.out = torch.empty(n, dtype=out_dtype or grad_dtype) if with_out else None
        self.ref_out = torch.empty(n, dtype=out_dtype or grad_dtype) if with_out else None
        self.param = torch.nn.Parameter(start.clone())
        kind = torch.optim.AdamW if decoupled else torch.optim.Adam
        self.opt = kind([self.param], lr=LR, betas=(beta1, BETAS[1]), eps=EPS, weight_decay=wd, maximize=maximize,
                        fused=True)
        self.step = 0

    def advance(self, scale, threads):
        self.step += 1
        grad = (torch.randn(self.n, generator=self.gen) * 3e-2).to(self.grad_dtype)
        buf = grad.to(torch.float32, copy=True)  # today's path
        if scale != 1.0:
            buf.mul_(scale)
        self.param.grad = buf
        self.opt.step()
        if self.ref_out is not None:
            self.ref_out.copy_(self.param.detach())
        cpu_update.fused_adam_step(self.master, self.m, self.v, grad, self.out, scale=scale, lr=LR, beta1=self.beta1,
                                   beta2=BETAS[1], eps=EPS, weight_decay=self.wd, step=self.step,
                                   decoupled=self.decoupled, maximize=self.maximize, threads=threads)

    def differences(self) -> list[str]:
        state = self.opt.state[self.param]
        pairs = [("master", self.master, self.param.detach()), ("exp_avg", self.m, state["exp_avg"]),
                 ("exp_avg_sq", self.v, state["exp_avg_sq"])]
        if self.out is not None:
            pairs.append(("out", self.out, self.ref_out))
        return [f"{what}: {int((_bits(a) != _bits(b)).sum())} of {self.n} elements differ"
                for what, a, b in pairs if not torch.equal(_bits(a), _bits(b))]


def check(sizes=SIZES, grad_out=GRAD_OUT, scales=SCALES, threads=(1, 2), steps=4) -> list[str]:
    """Every combination; returns what differed (empty: all bitwise equal)."""
    failures = []
    previous = torch.get_num_threads()
    try:
        for n, (dtype, with_out), decoupled, wd in itertools.product(sizes, grad_out, (False, True), (0.0, 0.1)):
            for scale, nthreads in itertools.product(scales, threads):
                torch.set_num_threads(nthreads)
                gen = torch.Generator().manual_seed(n)
                pair = Pair(n, dtype, with_out, decoupled, wd, gen)
                for _ in range(steps):
                    pair.advance(scale, nthreads)
                    diff = pair.differences()
                    if diff:
                        failures.append(f"n={n} grad={dtype} out={with_out} {'AdamW' if decoupled else 'Adam'} "
                                        f"wd={wd} scale={scale} threads={nthreads} step={pair.step}: {diff}")
                        break
    finally:
        torch.set_num_threads(previous)
    return failures


def test_bitwise_equal_to_the_four_passes(built):
    # Two threads split the work on 16-element boundaries, as torch does; fewer cases, since an
    # OpenMP barrier on a loaded machine costs milliseconds.
    failures = check(threads=(1,)) + check(sizes=(63, 1000, 100_003), scales=(0.37,), threads=(2,))
    assert not failures, f"{len(failures)} cases differ, e.g.\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("beta1,maximize", [(0.9, True), (0.3, False)])
def test_bitwise_maximize_and_a_large_lerp_weight(built, beta1, maximize):
    for n, decoupled in itertools.product((63, 1000), (False, True)):
        pair = Pair(n, torch.bfloat16, True, decoupled, 0.1, torch.Generator().manual_seed(1), beta1, maximize)
        for _ in range(3):
            pair.advance(0.37, 1)
            assert not pair.differences(), (n, decoupled, pair.step, pair.differences())


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_bitwise_with_another_out_dtype_and_empty(built, grad_dtype, out_dtype):
    for n in (0, 1000):
        pair = Pair(n, grad_dtype, True, True, 0.1, torch.Generator().manual_seed(2), out_dtype=out_dtype)
        for _ in range(2):
            pair.advance(0.37, 1)
            assert not pair.differences(), (n, pair.step, pair.differences())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lookahead_terms_written_in_the_same_pass_are_torchs_bits(built, out_dtype):
    """The delayed update's lookahead ``base`` and ``rate`` (raydeep.tier.lookahead), written by
    the fused pass from the registers it updated, equal the torch path's separate pass over the
    updated master and moments, bit for bit: every tail, both forms, maximize, two threads."""
    from raydeep.tier.lookahead import constants, write_terms

    previous = torch.get_num_threads()
    try:
        for n, decoupled, wd, maximize, threads in [(1, True, 0.1, False, 1), (7, False, 0.1, False, 1),
                                                   (63, True, 0.0, True, 1), (1000, False, 0.0, True, 2),
                                                   (100_003, True, 0.1, False, 2), (100_003, False, 0.1, False, 1)]:
            torch.set_num_threads(threads)
            gen = torch.Generator().manual_seed(n)
            start = torch.randn(n, generator=gen)
            fused = [start.clone(), torch.zeros(n), torch.zeros(n)] + [torch.empty(n, dtype=out_dtype) for _ in range(3)]
            ref = [start.clone(), torch.zeros(n), torch.zeros(n)] + [torch.empty(n, dtype=out_dtype) for _ in range(3)]
            for step in range(1, 4):
                grad = (torch.randn(n, generator=gen) * 3e-2).to(torch.bfloat16)
                hyper = dict(scale=0.37, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=wd, step=step,
                             decoupled=decoupled, maximize=maximize, threads=threads)
                terms = constants({"lr": LR, "eps": EPS, "weight_decay": wd, "betas": BETAS, "maximize": maximize},
                                  float(step), decoupled)
                cpu_update.fused_adam_step(*fused[:3], grad, fused[3], **hyper, lookahead=(*fused[4:], terms))
                cpu_update._torch_step(*ref[:3], grad, ref[3], **hyper)
                write_terms(*ref[:3], *ref[4:], terms, decoupled)
                for what, a, b in zip(("master", "exp_avg", "exp_avg_sq", "out", "base", "rate"), fused, ref):
                    assert torch.equal(_bits(a), _bits(b)), (what, n, decoupled, wd, maximize, threads, step)
    finally:
        torch.set_num_threads(previous)


def _python(code: str, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_forced_fallback_is_unavailable_and_computes_the_same_bits():
    result = _python(
        "import json, warnings\n"
        "warnings.simplefilter('error')\n"  # the forced fallback does not warn
        "from raydeep.tier import cpu_update\n"
        "from tests.unit.test_cpu_update import check\n"
        "ok = cpu_update.available()\n"
        "bad = check(sizes=(7, 1000), scales=(0.37,), threads=(1,), steps=2)\n"
        "print(json.dumps({'available': ok, 'status': cpu_update.status(), 'failures': bad}))\n",
        RAYDEEP_CPU_UPDATE="torch")
    assert result == {"available": False, "status": "RAYDEEP_CPU_UPDATE=torch", "failures": []}


_LOAD_AND_SAY = (
    "import json, sys, warnings\n"
    "from raydeep.tier import cpu_update\n"
    "with warnings.catch_warnings():\n"
    "    warnings.simplefilter('ignore')\n"
    "    ok = cpu_update.available()\n"
    "print(json.dumps({'available': ok, 'status': cpu_update.status(),\n"
    "                  'builder_imported': 'torch.utils.cpp_extension' in sys.modules}))\n")


def test_a_new_process_loads_the_recorded_library_without_torch_s_builder(built, tmp_path):
    """The first step of every new worker process (a restart's included) used to import torch's
    extension builder, and with it setuptools, only to learn that the library was built: 0.3 s on
    a loaded machine. A build records where its library is; a later process loads it directly.
    A record that points nowhere is passed over: the process builds (here: finds) it as before."""
    cache = {"XDG_CACHE_HOME": str(tmp_path)}
    first = _python(_LOAD_AND_SAY, **cache)  # nothing recorded in this cache yet: torch's builder
    assert first["available"] and first["builder_imported"], first
    record = next((tmp_path / "raydeep" / "cpu_update").iterdir())
    assert record.read_text() == first["status"]

    second = _python(_LOAD_AND_SAY, **cache)
    assert second == {"available": True, "status": first["status"], "builder_imported": False}

    record.write_text(str(tmp_path / "gone.so"))
    third = _python(_LOAD_AND_SAY, **cache)
    assert third == {"available": True, "status": first["status"], "builder_imported": True}
    assert record.read_text() == first["status"]  # recorded again


_LOWER = {"AVX512": ("avx2", "default"), "AVX2": ("default",)}.get(torch.backends.cpu.get_cpu_capability(), ())


@pytest.mark.parametrize("capability", _LOWER)
def test_bitwise_on_a_lower_capability(built, capability):
    """What a CI machine with a narrower CPU dispatches to: the variant built for it must match
    torch's kernel for it (torch picks it from ATEN_CPU_CAPABILITY)."""
    result = _python(
        "import json, warnings\n"
        "import torch\n"
        "from raydeep.tier import cpu_update\n"
        "from tests.unit.test_cpu_update import check\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    ok = cpu_update.available()\n"
        "bad = check(sizes=(1, 7, 63, 1031), scales=(1.0, 0.37), threads=(1,), steps=2) if ok else []\n"
        "print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), 'available': ok,\n"
        "                  'status': cpu_update.status(), 'failures': bad[:5]}))\n",
        ATEN_CPU_CAPABILITY=capability)
    assert result["capability"] == capability.upper()
    assert result["available"], result["status"]
    assert result["failures"] == []


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on_forever(tmp_path):
    """torch's extension builder waits without a limit for its ``lock`` file: one left by a killed
    build would hang every later process (``make`` included). Stale: removed, with a warning."""
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        assert cpu_update.clear_stale_lock(str(tmp_path), stale_after=600)
    assert not lock.exists()
    assert not cpu_update.clear_stale_lock(str(tmp_path))  # no lock: nothing to do, no wait


def test_a_fresh_build_lock_is_another_build_in_progress_and_is_waited_for(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    finished = threading.Timer(0.3, lock.unlink)  # the other process's build ends
    finished.start()
    began = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # waiting for a live build warns nothing
        assert not cpu_update.clear_stale_lock(str(tmp_path), stale_after=600, poll=0.05)
    assert 0.25 <= time.monotonic() - began < 10
    # A build that stops updating its lock past the limit is taken for dead while waiting.
    lock.write_text("")
    with pytest.warns(UserWarning, match="did not finish"):
        assert cpu_update.clear_stale_lock(str(tmp_path), stale_after=0.2, poll=0.05)
