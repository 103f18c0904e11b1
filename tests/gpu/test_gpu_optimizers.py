"""raydeep's optimizers against DeepSpeed's CUDA kernels (run with ``-m gpu`` on a CUDA machine).

DeepSpeed picks its accelerator, and with it which op builders exist, once per process, when
``deepspeed.ops.op_builder`` is first imported; tests/conftest.py sets ``DS_ACCELERATOR=cpu`` for
the CPU suite, under which FusedLamb has no builder. So the kernel runs in a child process with
``DS_ACCELERATOR=cuda``, whatever this process imported before, and raydeep's ``Lamb`` runs here
on the same device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raydeep.optim.optimizers import Lamb

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

START, GRADS, LR = [1.0, 2.0, 2.0], [[0.5, -1.0, 2.0], [-0.3, 0.2, 1.0]], 0.05

_FUSED_LAMB = """
import json, sys
import torch
from deepspeed.ops.lamb import FusedLamb

start, grads, lr = json.loads(sys.argv[1])
w = torch.nn.Parameter(torch.tensor(start, device="cuda"))
opt = FusedLamb([w], lr=lr)
for g in grads:
    w.grad = torch.tensor(g, device="cuda")
    opt.step()
print("RESULT", json.dumps(w.detach().cpu().tolist()))
"""
# Words in a failed JIT build's output: the machine lacks the CUDA toolkit, not the kernel a fix.
_NO_TOOLCHAIN = ("nvcc", "CUDA_HOME", "ninja", "No such file or directory: 'c++'")


def fused_lamb_on_cuda() -> list[float]:
    """DeepSpeed's FusedLamb kernel (JIT-built on first use) over ``GRADS`` from ``START``."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cuda")
    done = subprocess.run([sys.executable, "-c", _FUSED_LAMB, json.dumps([START, GRADS, LR])], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        if any(word in done.stderr for word in _NO_TOOLCHAIN):
            pytest.skip(f"FusedLamb's JIT build needs the CUDA toolkit: {done.stderr[-500:]}")
        raise AssertionError(f"FusedLamb on CUDA failed:\n{done.stderr[-3000:]}")
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_lamb_matches_deepspeed_fused_lamb_kernel():
    theirs = torch.tensor(fused_lamb_on_cuda())
    w = torch.nn.Parameter(torch.tensor(START, device="cuda"))
    ours = Lamb([w], lr=LR)
    for g in GRADS:
        w.grad = torch.tensor(g, device="cuda")
        ours.step()
    # Both are fp32 on the same device; they may differ in the order of the norms' sums and in a
    # fused multiply-add, a few roundings of each step's update and of the weights it is added to.
    # Two steps at 8 ulps each of the largest weight bound that; a wrong trust ratio, moment or
    # bias correction moves the weights by a sizeable part of lr (0.05) instead.
    bound = 2 * 8 * torch.finfo(torch.float32).eps * max(abs(x) for x in START)
    moved = (torch.tensor(START) - theirs).abs().max().item()
    assert moved > 0.1 * LR, f"FusedLamb did not step: {theirs.tolist()}"
    assert (w.detach().cpu() - theirs).abs().max().item() <= bound, (w.tolist(), theirs.tolist())
