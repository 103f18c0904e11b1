import os
import re

import pytest

# Tests talk to local Ray clusters without token auth, and never wait long for workers.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Packages the peer tests compare against. Under CI=true a peer test never skips silently: a
# test marked ``peers`` that skips (for whatever reason: the peer is what it exists to test)
# fails, and so does a test module skipped at import because one of these cannot be imported.
# A skip that has nothing to do with a peer (no CUDA device, say) belongs on a test not marked
# ``peers``.
PEER_PACKAGES = ("deepspeed", "moto", "transformers", "accelerate")
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _missing_package(reason: str) -> str | None:
    found = _IMPORT_SKIP.search(reason)
    return found.group(1).split(".")[0] if found else None


def _peer_failure(reason: str) -> str:
    package = _missing_package(reason)
    what = f"peer package {package!r} cannot be imported" if package else "a peer test was skipped"
    return (f"{what} under CI=true, so this run would not test what it claims: {reason}\n"
            "Install the peers (pip install -e '.[test,peers]'), or unset CI to let peer tests skip locally.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (report.skipped and not hasattr(report, "wasxfail") and _under_ci()
            and item.get_closest_marker("peers") is not None):
        report.outcome = "failed"
        report.longrepr = _peer_failure(_skip_reason(report))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped and _under_ci() and _missing_package(_skip_reason(report)) in PEER_PACKAGES:
        report.outcome = "failed"
        report.longrepr = _peer_failure(_skip_reason(report))
    return report



@pytest.fixture(autouse=True)
def _grad_mode_is_left_on():
    """A test that leaves autograd switched off (an abandoned generator inside ``no_grad``, say)
    breaks every later test in the process with a misleading error; fail the culprit instead."""
    import torch

    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("this test left torch's grad mode off", pytrace=False)
