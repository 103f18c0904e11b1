"""The import hook behind :func:`raydeep.compat.install`: ``deepspeed`` resolves to raydeep's
compatibility package, and ``importlib.metadata`` finds a ``deepspeed`` distribution.

Both halves are needed because transformers and accelerate test for DeepSpeed the way pip sees
it: ``importlib.util.find_spec("deepspeed")`` *and* ``importlib.metadata.metadata("deepspeed")``
(whose version they compare against minimums and feature thresholds). A module placed in
``sys.modules`` passes neither; a finder on ``sys.meta_path`` answers both.

Only the top-level name is mapped. The package is loaded from ``raydeep/compat/deepspeed`` under
the name ``deepspeed`` with that folder as its ``__path__``, so ``deepspeed.comm``,
``deepspeed.runtime.engine`` and the rest are ordinary submodules that Python's path finder
loads from the same folder, each once, under DeepSpeed's names.
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import os
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent / "deepspeed"
NAME = "deepspeed"


class CompatDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution importlib.metadata reports while the finder is installed.
    Its version is the DeepSpeed release raydeep is checked against, which is what steers the
    version-gated code paths in transformers and accelerate."""

    def __init__(self, version: str):
        self._version = version

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {self._version}\n"
                    "Summary: DeepSpeed's API served by raydeep (raydeep.compat)\n")
        if filename == "top_level.txt":
            return f"{NAME}\n"
        return None

    def locate_file(self, path):
        return PACKAGE_DIR / path


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Maps the top-level ``deepspeed`` import to the compatibility package."""

    def __init__(self, version: str):
        self.version = version

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None  # submodules come from the package's __path__
        return importlib.util.spec_from_file_location(
            NAME, os.fspath(PACKAGE_DIR / "__init__.py"), submodule_search_locations=[os.fspath(PACKAGE_DIR)])

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or _normalise(name) == NAME:
            yield CompatDistribution(self.version)


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def is_compat_module(module) -> bool:
    """Whether ``module`` (a ``deepspeed`` module object) was loaded from the compatibility package."""
    origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
    return origin is not None and pathlib.Path(origin).resolve().is_relative_to(PACKAGE_DIR)
