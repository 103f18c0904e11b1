"""Client patterns behave under raydeep as under DeepSpeed: ``scripts/client_patterns.py`` runs
once with ``--lib deepspeed`` and once with ``--lib raydeep`` (the two imports a client changes)
on 2 gloo ranks under torchrun, every pattern at ZeRO stages 0-3 in one launch each, and the
two records must agree:

- ``documented`` (DeepSpeed's loop: ``engine(batch)``, ``backward``, ``step``; GAS 2, clipping,
  WarmupLR): per-micro-step losses of every rank within ``TOL``; learning rates, counters
  (``global_steps``, ``global_samples``, ``micro_steps``), the checkpoint's tag, ``latest`` and
  the client state handed back by ``load_checkpoint`` equal exactly; and within each library,
  a fresh engine that loads the checkpoint continues with exactly the losses of the engine that
  saved it.
- ``ray`` (Ray Train's DeepSpeed example: the client steps ``optimizer``, ``lr_scheduler`` and
  ``zero_grad`` itself, GAS 1): losses within ``TOL``; the scheduler's ``get_last_lr()``, the
  engine's counters after every step, the data loader's length, ranks, device, evaluation
  accuracy and the tag directories ``save_checkpoint(tmpdir)`` creates in each rank's own
  directory equal exactly; the ranks' directories, copied into one as Ray Train uploads them,
  load into a new engine with the saved weights exactly. What DeepSpeed reports here is its
  behaviour when the client steps: the engine's counters do not move (every save is tagged
  ``global_step0``), the scheduler alone sets the learning rate, and at fp32 stage 0 the
  returned optimizer is torch's own, which does not clip.
- ``bf16`` (``documented`` with bf16, stage 2): losses within 2 bf16 ulps; the rest as above.

Tolerances. The first micro-step's loss is the same arithmetic on the same weights and inputs in
both libraries, so its bits must be equal. After that, gradients are reduced over 2 ranks (a
sum of two float32 values is the same in either order, and halving is exact) and clipped and
applied by different code: the global norm's summation order, the clip coefficient's rounding
and the AdamW kernel (fused or for-each) each differ by float32 rounding, a few ulps of each
update, i.e. parameters that differ by about an ulp. The loss moves by sum |dL/dθ|·|Δθ| over
~4.4k parameters, far below a loss ulp per step, but Adam divides by sqrt(v): a component
whose gradient is rounding noise gets a step of order lr whatever its size, so differences
can grow to well above an ulp within a few steps. ``TOL`` is the bound the DeepSpeed parity
test (tests/dist/test_deepspeed_parity.py) uses for the same optimizer and clipping over 5
steps, 1e-5: about 80 ulps of a loss near 1.4 (ulp 1.2e-7), and still below what one wrong
decision changes (a clip applied where DeepSpeed's torch optimizer applies none moves the
``ray`` pattern's fourth loss by 6e-5; a learning rate one scheduler step off, or a lost
optimizer state, by more). With bf16 the loss itself is rounded to bf16 (ulp 2^-7 for losses
in [1, 2)), and parameters whose fp32 masters differ by an ulp round to bf16 values one bf16
ulp apart when a master sits next to a rounding boundary, so a loss may land one bf16 ulp
away: the bound there is 2 bf16 ulps at the loss's size (``_bf16_tol``).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.dist.harness import free_port
from tests.dist.test_deepspeed_parity import TOL

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "client_patterns.py")
STAGES = ("0", "1", "2", "3")  # JSON keys


def _launch(out_dir, lib: str) -> list[dict]:
    """One torchrun launch of every pattern and stage with ``lib``: each rank's record."""
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           SCRIPT, "--lib", lib, "--out", str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"{lib} launch failed:\n" + done.stdout[-2000:] + done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["ranks"]


def _tail(text: str, lines: int = 4) -> str:
    """A traceback's last lines: where it was raised and what was raised."""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def _bf16_tol(loss: float) -> float:
    return 2 * 2.0 ** (math.floor(math.log2(abs(loss))) - 7)


class Checks:
    """Collects every mismatch (the test reports them all at once) and the worst loss difference
    per (pattern, stage)."""

    def __init__(self):
        self.failures: list[str] = []
        self.loss_diff: dict[tuple[str, str], float] = {}

    def equal(self, where: str, what: str, ours, theirs) -> None:
        if ours != theirs:
            self.failures.append(f"{where}: {what}: raydeep {ours!r}, DeepSpeed {theirs!r}")

    def losses(self, where: str, key: tuple[str, str], ours: list[float], theirs: list[float], bf16: bool) -> None:
        if len(ours) != len(theirs):
            self.failures.append(f"{where}: {len(ours)} losses, DeepSpeed {len(theirs)}")
            return
        if ours and ours[0] != theirs[0]:
            self.failures.append(f"{where}: first loss {ours[0]!r} differs from DeepSpeed's {theirs[0]!r} "
                                 "(same weights, same inputs: must be equal)")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            diff = abs(a - b)
            self.loss_diff[key] = max(self.loss_diff.get(key, 0.0), diff)
            bound = _bf16_tol(b) if bf16 else TOL
            if diff > bound:
                self.failures.append(f"{where}: loss {i} {a!r} vs DeepSpeed's {b!r} (|diff| {diff:.3g} > {bound:.3g})")
                return


def _tags(listing: dict) -> dict:
    """What a client can rely on in a checkpoint directory: the tag directories and ``latest``
    (DeepSpeed also writes its zero_to_fp32.py helpers; the files inside a tag are the library's)."""
    return {"tags": [e for e in listing["entries"] if e.endswith("/")], "latest": listing["latest"]}


def _tag(path: str | None) -> str | None:
    """The tag of the path ``load_checkpoint`` returns, relative to the save directory (DeepSpeed
    names a file in the tag's directory; which file is the library's layout)."""
    return None if path is None else path.split(os.sep)[0]


def _check_documented(checks: Checks, pattern: str, stage: str, rank: int, ours: dict, theirs: dict) -> None:
    where = f"{pattern}/stage {stage}/rank {rank}"
    ours_losses = ours["before"]["losses"] + ours["continued"]["losses"]
    theirs_losses = theirs["before"]["losses"] + theirs["continued"]["losses"]
    checks.losses(where, (pattern, stage), ours_losses, theirs_losses, bf16=pattern == "bf16")
    for part in ("before", "continued"):
        checks.equal(where, f"lr ({part})", ours[part]["lr"], theirs[part]["lr"])
        for a, b in zip(ours[part]["grad_norm"], theirs[part]["grad_norm"]):
            if a is not None and b is not None and abs(a - b) > 1e-5 * b:  # relative: a sum of squares
                checks.failures.append(f"{where}: grad norm ({part}) {a!r} vs DeepSpeed's {b!r}")
    for counters in ("at_save", "end", "after_load", "reloaded_end"):
        checks.equal(where, counters, ours[counters], theirs[counters])
    checks.equal(where, "save_checkpoint's return", ours["saved"], theirs["saved"])
    checks.equal(where, "checkpoint directory", _tags(ours["listing"]), _tags(theirs["listing"]))
    checks.equal(where, "load_checkpoint's path (its tag)", _tag(ours["load_path"]), _tag(theirs["load_path"]))
    checks.equal(where, "client_state handed back", ours["client_state"], ours["client_state_sent"])
    if ours["reloaded"]["losses"] != ours["continued"]["losses"]:
        checks.failures.append(f"{where}: losses after load_checkpoint {ours['reloaded']['losses']} differ from "
                               f"the saving engine's {ours['continued']['losses']}")
    checks.equal(where, "lr after load_checkpoint", ours["reloaded"]["lr"], ours["continued"]["lr"])


def _check_ray(checks: Checks, stage: str, rank: int, ours: dict, theirs: dict) -> None:
    where = f"ray/stage {stage}/rank {rank}"
    for key in ("device", "global_rank", "local_rank", "batches_per_epoch", "optimizer_is_engine_optimizer",
                "initial_lr", "engine_lr"):
        checks.equal(where, key, ours[key], theirs[key])
    checks.equal(where, "epochs", len(ours["epochs"]), len(theirs["epochs"]))
    checks.losses(where, ("ray", stage), [x for e in ours["epochs"] for x in e["losses"]],
                  [x for e in theirs["epochs"] for x in e["losses"]], bf16=False)
    for epoch, (a, b) in enumerate(zip(ours["epochs"], theirs["epochs"])):
        at = f"{where}/epoch {epoch}"
        for key in ("lr", "counters", "engine_lr", "eval_correct", "saved", "end"):
            checks.equal(at, key, a[key], b[key])
        checks.equal(at, "checkpoint directory", _tags(a["checkpoint"]), _tags(b["checkpoint"]))
        if abs(a["eval_loss"] - b["eval_loss"]) > 2 * TOL:  # a sum of two batches' losses
            checks.failures.append(f"{at}: eval loss {a['eval_loss']!r} vs DeepSpeed's {b['eval_loss']!r}")
    _check_ray_restore(checks, where, ours, theirs)


def _check_ray_restore(checks: Checks, where: str, ours: dict, theirs: dict) -> None:
    """The checkpoint the ranks saved into their own directories, uploaded together as Ray Train
    does, loads into a new engine: the same weights (its evaluation equals the last epoch's
    exactly), and what the engine and scheduler report after the load as DeepSpeed's do."""
    mine, ref = ours["restored"], theirs["restored"]
    assert "error" not in ref, f"DeepSpeed (the reference) could not load its checkpoint:\n{_tail(ref['error'])}"
    if "error" in mine:
        checks.failures.append(f"{where}: loading the uploaded checkpoint failed:\n{_tail(mine['error'])}")
        return
    where = f"{where}/restored"
    checks.equal(where, "load_checkpoint's path (its tag)", _tag(mine["load_path"]), _tag(ref["load_path"]))
    for key in ("counters", "lr", "engine_lr", "eval_correct"):
        checks.equal(where, key, mine[key], ref[key])
    if mine["eval_loss"] != ours["epochs"][-1]["eval_loss"]:
        checks.failures.append(f"{where}: eval loss {mine['eval_loss']!r} after the load differs from the saved "
                               f"weights' {ours['epochs'][-1]['eval_loss']!r}")


def _compare(ours: list[dict], theirs: list[dict]) -> Checks:
    checks = Checks()
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        for case, text in sorted(ref["errors"].items()):
            checks.failures.append(f"DeepSpeed (the reference) failed {case} on rank {rank}:\n{_tail(text)}")
        for case, text in sorted(mine["errors"].items()):
            checks.failures.append(f"raydeep failed {case} on rank {rank}:\n{_tail(text)}")
        for pattern, by_stage in ref["results"].items():
            for stage, record in by_stage.items():
                if stage not in mine["results"].get(pattern, {}):
                    continue  # reported above as raydeep's error
                if pattern == "ray":
                    _check_ray(checks, stage, rank, mine["results"][pattern][stage], record)
                else:
                    _check_documented(checks, pattern, stage, rank, mine["results"][pattern][stage], record)
    return checks


@pytest.mark.peers
def test_client_patterns_match_deepspeed(tmp_path, capsys):
    pytest.importorskip("deepspeed", exc_type=ImportError)
    theirs = _launch(tmp_path / "deepspeed", "deepspeed")
    for pattern in ("documented", "ray"):
        assert tuple(theirs[0]["results"].get(pattern, ())) == STAGES, f"DeepSpeed: {theirs[0]['errors']}"
    ours = _launch(tmp_path / "raydeep", "raydeep")
    checks = _compare(ours, theirs)
    with capsys.disabled():
        print(f"\nclient patterns, raydeep vs DeepSpeed: max |loss diff| over ranks and steps (TOL {TOL:g})")
        for (pattern, stage), diff in sorted(checks.loss_diff.items()):
            print(f"  {pattern:>10} stage {stage}: {diff:.3g}")
    if checks.failures:
        pytest.fail(f"{len(checks.failures)} mismatches with DeepSpeed:\n" + "\n".join(checks.failures), pytrace=False)
