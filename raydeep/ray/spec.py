"""TrainSpec: everything a run is, decided once on the driver and shipped to every worker.

A run is identified by ``(storage_path, name)``: running the same pair again continues it from
its last checkpoint (up to ``steps``, at whatever ``num_workers`` it is given now).

>>> spec = TrainSpec(num_workers=parse_num_workers("1:2"), steps=10)
>>> spec.min_workers, spec.max_workers, spec.run_uri.endswith(spec.name)
(1, 2, True)
"""
from __future__ import annotations

import copy
import os
import time
import uuid
from dataclasses import dataclass, field

from raydeep.errors import ConfigError, InputError

BUILTIN_DATA = ("builtin", "synthetic")  # --data values that name a source instead of a path

# The README run: the tiny GPT with ZeRO-3. The global batch (16) stays fixed; at 2 workers each
# accumulates once, at 1 worker twice. "auto" in the schedule is filled from --steps.
DEFAULT_DS_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                      "warmup_max_lr": 2e-3, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
}


def parse_num_workers(text: str | int | tuple[int, int]) -> int | tuple[int, int]:
    """``"2"`` -> 2 (fixed), ``"1:4"`` -> (1, 4) (elastic), as ``ScalingConfig(num_workers=...)`` takes them."""
    if isinstance(text, (int, tuple)):
        value = text
    else:
        parts = str(text).split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (1, 2):
            raise ConfigError("num_workers", "must be N or MIN:MAX", value=text, fix="e.g. --num-workers 2 or 1:4")
        value = numbers[0] if len(numbers) == 1 else tuple(numbers)
    low, high = (value, value) if isinstance(value, int) else value
    if not 1 <= low <= high:
        raise ConfigError("num_workers", "needs 1 <= MIN <= MAX", value=text, fix="e.g. --num-workers 2 or 1:4")
    return value


def default_run_name() -> str:
    return time.strftime("raydeep-%Y%m%d-%H%M%S")


def _normalise_storage(path: str) -> str:
    # Ray Train resolves a local storage path the same way; the engine's checkpoint URIs must name
    # the same directory, so both start from the absolute form.
    return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


def _normalise_data(data: str) -> str:
    # Workers run in another working directory than the driver: a relative local path found here
    # would name nothing there. The built-in sources are names, URIs are already absolute.
    if data in BUILTIN_DATA or "://" in data:
        return data
    return os.path.abspath(os.path.expanduser(data))


def check_storage(storage_path: str) -> None:
    """Refuse a storage path the run cannot write to, before any worker starts: a probe file is
    created and removed where the run will write (for a local path that does not exist yet, in
    its nearest existing parent: the run creates the rest), so the check leaves nothing behind.

    >>> import tempfile
    >>> check_storage(tempfile.mkdtemp() + "/runs")
    """
    import pyarrow as pa
    import pyarrow.fs as pafs

    from raydeep.storage import Storage

    try:
        store = Storage.open(storage_path)
        directory = store.root
        # Object stores have no directories to create: a write under the root is the whole test.
        while store.is_local and store.fs.get_file_info(directory).type == pafs.FileType.NotFound:
            directory = os.path.dirname(directory)
        if store.fs.get_file_info(directory).type == pafs.FileType.File:
            raise NotADirectoryError(f"{directory} is a file, not a directory")
        probe = f"{directory.rstrip('/')}/.raydeep-write-probe-{uuid.uuid4().hex}"
        with store.fs.open_output_stream(probe):
            pass
        store.fs.delete_file(probe)
    except (OSError, ValueError, pa.ArrowException) as exc:  # a bad URI, no access, a file in the way
        shown = storage_path.split("?", 1)[0]  # URI query options may carry credentials
        raise InputError("--storage-path", f"cannot write there ({exc})", value=shown,
                         fix="pass a directory you can write to (it is created if missing), or an s3:// / gs:// "
                         "URI you have write access to") from None


@dataclass
class TrainSpec:
    """One training run (see the module docstring). ``ds_config`` is a dict, path, JSON or base64."""

    ds_config: object = field(default_factory=lambda: copy.deepcopy(DEFAULT_DS_CONFIG))
    model: str = "gpt-tiny"              # a GPT size name, or "package.module:function" returning the model
    data: str = "builtin"                # "builtin" (embedded corpus), "synthetic", or a Parquet path/URI
    num_workers: int | tuple[int, int] = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    resources_per_worker: dict = field(default_factory=dict)
    steps: int = 200                     # the global step to train to
    checkpoint_every: int = 50           # steps between checkpoints (one is always taken at the end)
    storage_path: str = "runs"
    name: str = field(default_factory=default_run_name)
    max_failures: int = 3
    seed: int = 0
    export_fp32: bool = False            # write the consolidated fp32 weights next to summary.json
    overrides: list[str] = field(default_factory=list)  # "dotted.key=JSON" applied to ds_config

    def __post_init__(self):
        self.num_workers = parse_num_workers(self.num_workers)
        self.storage_path = _normalise_storage(self.storage_path)
        self.data = _normalise_data(self.data)
        if "://" not in self.storage_path:
            # Local: cheap, so checked as the spec is made. Probing a remote store needs the
            # network, which making a spec should not: the driver's plan_run probes those.
            check_storage(self.storage_path)
        if self.steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("steps", "steps and checkpoint_every must be >= 0", value=(self.steps,
                              self.checkpoint_every), fix="pass non-negative numbers")
        if not self.name or "/" in self.name:
            raise ConfigError("name", "must be a non-empty name without '/'", value=self.name,
                              fix="e.g. --name gpt-tiny-zero3")

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def run_uri(self) -> str:
        """``<storage_path>/<name>``: Ray Train's run directory, which also holds raydeep's files."""
        return f"{self.storage_path}/{self.name}"

    @property
    def checkpoint_uri(self) -> str:
        return f"{self.run_uri}/checkpoints"

    def resolved_ds_config(self) -> dict:
        """The ds_config as a dict with ``overrides`` applied and the schedule's ``"auto"`` lengths
        filled from ``steps`` (warm-up: a tenth of the run), as an HF-style launcher would."""
        from raydeep.config.loading import apply_overrides, read_config

        data = apply_overrides(read_config(self.ds_config), self.overrides)
        params = (data.get("scheduler") or {}).get("params") or {}
        for key, value in (("total_num_steps", max(1, self.steps)), ("warmup_num_steps", max(1, self.steps // 10))):
            if params.get(key) == "auto":
                params[key] = value
        return data
