"""The peer guard in tests/conftest.py: under CI=true a test marked ``peers`` that skips, or a test
module skipped at import for want of a peer package, fails the run; without CI it skips.

Each case runs pytest in a subprocess on a small generated project that uses the suite's own
conftest (copied verbatim), with CI set or unset.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

PEER_TESTS = '''
import pytest

@pytest.fixture
def peer():
    return pytest.importorskip("raydeep_no_such_peer")

@pytest.mark.peers
def test_peer_import_in_test():
    pytest.importorskip("raydeep_no_such_peer.sub", exc_type=ImportError)

@pytest.mark.peers
def test_peer_import_in_fixture(peer):
    pass

@pytest.mark.peers
def test_peer_present():
    assert pytest.importorskip("json").dumps(1) == "1"

@pytest.mark.peers
@pytest.mark.xfail(reason="a known difference from the peer", strict=True)
def test_peer_known_difference():
    assert False

def test_unrelated_skip():
    pytest.skip("nothing to do with a peer: no CUDA device, say")
'''

PEER_MODULE = '''
import pytest

moto = pytest.importorskip("moto.raydeep_no_such_module")

def test_never_collected():
    pass
'''


def run_pytest(tmp_path: Path, ci: bool, files: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    peers: needs a peer package\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def summary(done: subprocess.CompletedProcess) -> str:
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("ci", [True, False])
def test_peer_skips_fail_only_under_ci(tmp_path, ci):
    done = run_pytest(tmp_path, ci, {"test_peers.py": PEER_TESTS})
    out = done.stdout
    if ci:
        assert done.returncode == 1, out
        # the skip in the test body fails the test; the one in its fixture errors at setup
        assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in summary(done), out
        assert "FAILED test_peers.py::test_peer_import_in_test" in out
        assert "ERROR test_peers.py::test_peer_import_in_fixture" in out
        assert out.count("peer package 'raydeep_no_such_peer' cannot be imported under CI=true") >= 2, out
        assert "SKIPPED [1] test_peers.py" in out and "no CUDA device" in out  # not a peer skip
    else:
        assert done.returncode == 0, out
        assert "1 passed, 3 skipped, 1 xfailed" in summary(done), out


@pytest.mark.parametrize("ci", [True, False])
def test_peer_module_skipped_at_import_fails_only_under_ci(tmp_path, ci):
    done = run_pytest(tmp_path, ci, {"test_peer_module.py": PEER_MODULE})
    if ci:
        assert done.returncode != 0 and "1 error" in summary(done), done.stdout
        assert "peer package 'moto' cannot be imported under CI=true" in done.stdout
    else:
        assert done.returncode == 5 and "1 skipped" in summary(done), done.stdout  # 5: no tests ran
