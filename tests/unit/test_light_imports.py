"""The small actors of a run start without torch: each is a process of its own on the driver's
node (every run starts them, every test of tests/ray too), and importing torch and the engine
would cost each seconds of CPU and hundreds of MB for nothing it uses."""
import subprocess
import sys

import pytest

LIGHT = ["raydeep", "raydeep.ray.run_monitor", "raydeep.ray.memory_snapshots"]


@pytest.mark.parametrize("module", LIGHT)
def test_the_module_imports_without_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'raydeep.engine') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"importing {module} loads {done.stdout.strip()}"


def test_the_package_names_load_on_first_use():
    import raydeep

    assert raydeep.DeepSpeedEngine is raydeep.Engine and callable(raydeep.initialize)
    assert raydeep.zero.Init is not None and raydeep.comm.get_rank is not None  # subpackages as attributes
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        raydeep.no_such_name  # noqa: B018
