"""``import deepspeed`` served by raydeep, for code you do not edit: Hugging Face ``Trainer``
(``TrainingArguments(deepspeed=ds_config)``), Accelerate's ``DeepSpeedPlugin``, and any library
that imports DeepSpeed itself.

    import raydeep.compat
    raydeep.compat.install()            # before transformers / accelerate are imported
    from transformers import Trainer    # ... now trains on raydeep

or, for an unmodified script, ``python -m raydeep.compat train.py --deepspeed ds_config.json``
(also under ``torchrun ... -m raydeep.compat train.py``), or ``RAYDEEP_AS_DEEPSPEED=1`` with
:func:`install_if_requested`. Ray workers get it with
``runtime_env={"worker_process_setup_hook": "raydeep.compat.install"}``.

The decision, and why
---------------------
``import raydeep as deepspeed`` works for scripts you own. Libraries import ``deepspeed``
themselves, and transformers and accelerate decide once, when they are imported, whether
DeepSpeed exists: ``importlib.util.find_spec("deepspeed")`` and
``importlib.metadata.metadata("deepspeed")`` must both succeed, and the version must be at
least 0.9.3. A module put in ``sys.modules`` fails both tests. So :func:`install` puts a finder
first on ``sys.meta_path`` (:mod:`raydeep.compat.finder`) that answers both: ``deepspeed`` and
its submodules load from ``raydeep/compat/deepspeed`` (thin modules under DeepSpeed's names over
raydeep's engine, comm, zero, accelerator, optimizers and schedulers), and the metadata reports a
``deepspeed`` distribution.

The version reported is :data:`DEEPSPEED_VERSION`, the DeepSpeed release raydeep's behaviour is
checked against. It matters beyond the minimum: the libraries switch code paths on it (accelerate
calls ``engine.compile`` from 0.14.4, allows tensor parallelism from 0.16.4, transformers rescales
sequence-parallel losses below 0.20.2), so it must name a release whose behaviour raydeep has.

Limits
------
- Opt-in only: nothing is installed by importing raydeep, and there is no ``.pth`` hook. A
  process (or Ray worker) that did not call :func:`install` sees no DeepSpeed.
- It refuses to shadow a real DeepSpeed (an importable ``deepspeed`` that is not this package,
  or one already imported): which one a library would get would depend on import order.
- Call it before transformers or accelerate are imported; after, they have already decided
  that DeepSpeed is missing (a warning says so).
- It serves what raydeep implements: data-parallel ZeRO stages 0-3 with the engine's training
  API, checkpoints, ``zero.Init``/``GatheredParameters``, the accelerator and comm functions,
  DeepSpeed's schedulers, and ``DeepSpeedCPUAdam``/``FusedAdam`` as torch's Adam.
  DeepSpeed's tensor and sequence parallelism (``deepspeed.utils.groups``), MoE leaf modules
  (``set_z3_leaf_modules``), inference engine, JIT-built ops (``op_builder``) and launcher are
  not there: importing them fails with ``ImportError``.
- raydeep checkpoints are raydeep's format (``global_step<N>`` folders, as DeepSpeed names
  them); a DeepSpeed checkpoint is read through ``raydeep.checkpoint``'s importer, not here.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

from raydeep.compat.finder import NAME, DeepSpeedFinder, is_compat_module

DEEPSPEED_VERSION = "0.19.8"
ENV_FLAG = "RAYDEEP_AS_DEEPSPEED"

__all__ = ["DEEPSPEED_VERSION", "ENV_FLAG", "RealDeepSpeedInstalled", "advertised_version", "install",
           "install_if_requested", "installed", "uninstall"]


class RealDeepSpeedInstalled(ImportError):
    """A real DeepSpeed is importable in this environment, so raydeep will not pose as it."""


def _finder() -> DeepSpeedFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, DeepSpeedFinder)), None)


def installed() -> bool:
    """Whether ``import deepspeed`` reaches raydeep in this process."""
    return _finder() is not None


def advertised_version() -> str:
    """The DeepSpeed version ``deepspeed.__version__`` and the package metadata report."""
    finder = _finder()
    return finder.version if finder is not None else DEEPSPEED_VERSION


def install(version: str = DEEPSPEED_VERSION) -> None:
    """Make ``import deepspeed`` (and ``importlib.metadata``'s ``deepspeed``) resolve to raydeep in
    this process. Idempotent. Raises :class:`RealDeepSpeedInstalled` if DeepSpeed is installed."""
    if installed():
        return
    _refuse_real_deepspeed()
    loaded = sorted(name for name in ("transformers", "accelerate") if name in sys.modules)
    if loaded:
        warnings.warn(f"raydeep.compat.install() after {' and '.join(loaded)} was imported: they decide at import "
                      "whether DeepSpeed is installed, and have decided it is not. Install first.", stacklevel=2)
    importlib.invalidate_caches()
    sys.meta_path.insert(0, DeepSpeedFinder(version))


def install_if_requested() -> bool:
    """:func:`install` if ``RAYDEEP_AS_DEEPSPEED`` is set to 1/true/yes; returns whether it is installed."""
    if os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes"):
        install()
    return installed()


def uninstall() -> None:
    """Remove the finder and forget the ``deepspeed`` modules it served (libraries that already
    imported them keep their references)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedFinder)]
    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        if is_compat_module(sys.modules[name]):
            del sys.modules[name]
    importlib.invalidate_caches()


def _refuse_real_deepspeed() -> None:
    present = sys.modules.get(NAME)
    if present is not None and not is_compat_module(present):
        where = getattr(present, "__file__", "?")
    else:
        try:
            spec = importlib.util.find_spec(NAME)
        except (ImportError, ValueError):  # a blocker on sys.meta_path, or a broken stub
            spec = None
        if spec is None:
            return
        where = spec.origin
    raise RealDeepSpeedInstalled(
        f"DeepSpeed is installed ({where}); raydeep.compat will not pose as it, because which of the two a "
        "library imported would depend on import order. Use DeepSpeed, or a virtual environment without it "
        "(pip uninstall deepspeed), to train on raydeep through `import deepspeed`.")
