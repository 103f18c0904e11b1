"""``raydeep.compat``: what transformers and accelerate test before they use DeepSpeed, the
refusal to shadow an installed DeepSpeed, and the ``python -m raydeep.compat`` runner.

Each case runs in a fresh interpreter: the finder changes process-wide import state, and the
checks libraries make happen once, at their import. Where DeepSpeed is installed (the ``peers``
environment) the cases that need it absent put a blocker for it first on ``sys.meta_path``
(as ``trainer_script.HideDeepSpeed`` does).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts an interpreter that imports torch and raydeep
ROOT = Path(__file__).resolve().parents[2]
HIDE = textwrap.dedent("""
    import sys

    class Hide:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "deepspeed":
                raise ModuleNotFoundError("hidden", name=fullname)

    sys.meta_path.insert(0, Hide())
""")


def _python(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deepspeed_passes_the_checks_libraries_make():
    """And uninstall() forgets it; the package is never importable under its raydeep path."""
    done = _python("-c", HIDE + textwrap.dedent("""
        import importlib.metadata, importlib.util, json
        import raydeep.compat
        assert raydeep.compat.install_if_requested()  # RAYDEEP_AS_DEEPSPEED=1
        raydeep.compat.install()  # idempotent
        import deepspeed, deepspeed.comm, deepspeed.runtime.lr_schedules, deepspeed.ops.adam, deepspeed.zero
        from deepspeed.accelerator import get_accelerator
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        import raydeep
        out = {
            "spec": importlib.util.find_spec("deepspeed").origin,
            "version": importlib.metadata.version("deepspeed"),
            "name": importlib.metadata.metadata("deepspeed")["Name"],
            "dunder": deepspeed.__version__,
            "engine_is_raydeeps": deepspeed.DeepSpeedEngine is raydeep.Engine,
            "initialized": deepspeed.comm.is_initialized(),
            "schedules": deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,
            "installed": raydeep.compat.installed()}
        try:
            import raydeep.compat.deepspeed
        except ImportError:
            out["raydeep_path"] = "refused"
        raydeep.compat.uninstall()
        try:
            out["spec_after"] = importlib.util.find_spec("deepspeed") is not None
        except ModuleNotFoundError:
            out["spec_after"] = False
        out["left"] = sorted(n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed."))
        print(json.dumps(out))
    """), env={"RAYDEEP_AS_DEEPSPEED": "1"})
    out = _result(done)
    assert Path(out["spec"]).resolve().is_relative_to(ROOT / "raydeep" / "compat" / "deepspeed")
    assert out["version"] == out["dunder"] == "0.19.8" and out["name"] == "deepspeed"
    assert out["engine_is_raydeeps"] and out["installed"] and out["initialized"] is False
    assert "WarmupDecayLR" in out["schedules"] and out["raydeep_path"] == "refused"
    assert out["spec_after"] is False and out["left"] == []


def test_refuses_to_shadow_an_installed_deepspeed(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    done = _python("-c", HIDE.replace("sys.meta_path.insert(0, Hide())", "") + textwrap.dedent(f"""
        sys.path.insert(0, {str(tmp_path)!r})
        import raydeep.compat
        try:
            raydeep.compat.install()
        except raydeep.compat.RealDeepSpeedInstalled as err:
            print("refused:", err)
        else:
            print("installed")
    """))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("refused:") and "pip uninstall deepspeed" in done.stdout


def test_runner_installs_before_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import json, sys, deepspeed\n"
                      "print(json.dumps({'file': deepspeed.__file__, 'argv': sys.argv}))\n")
    hide = tmp_path / "sitecustomize.py"  # the runner itself must not be edited to hide DeepSpeed
    hide.write_text(HIDE)
    out = _result(_python("-m", "raydeep.compat", str(script), "--deepspeed", "ds.json",
                          env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}))
    assert Path(out["file"]).resolve().is_relative_to(ROOT / "raydeep" / "compat" / "deepspeed")
    assert out["argv"] == [str(script), "--deepspeed", "ds.json"]
