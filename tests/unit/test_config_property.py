"""Property: a mutated corpus config either loads or fails with a ConfigError naming a key.

Each example starts from a ``jobs/configs/`` file resolved with its overrides and fixes (the table in
``test_config_corpus.py``), applies one to three random mutations (delete a key, add a misspelled
key at any depth, change a value's type, set a known key to a random value, put "auto" somewhere)
and loads the result. Anything but a ``RaydeepConfig`` or a ``ConfigError`` whose ``.key`` is a
non-empty string shown in its message is a bug: the CLI would print a traceback for it.
"""
from __future__ import annotations

import copy
import json
import types
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from raydeep import cli
from raydeep.config import ConfigError, RaydeepConfig, load_config
from raydeep.config.loading import apply_overrides, read_config
from raydeep.config.model import UNSUPPORTED
from raydeep.config.zero import DEPRECATED_ZERO_KEYS
from raydeep.errors import ConfigErrors
from tests.unit.test_config_corpus import CONFIG_DIR, CORPUS

# Deterministic: the same examples on every run and every machine, nothing stored between runs.
PROPERTY_SETTINGS = settings(max_examples=1500, deadline=None, derandomize=True, database=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLI_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Each corpus file read and resolved with its overrides (and the fixes of refused settings) once:
# the starting points.
BASES: dict[str, dict] = {
    name: apply_overrides(read_config(str(CONFIG_DIR / name)), entry.overrides) for name, entry in CORPUS.items()
}


def _sections(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _sections(arg)]
    return []


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        for spelling in dict.fromkeys((name, info.alias or name)):
            keys.append(prefix + spelling)
            for sub in _sections(info.annotation):
                keys += _known_keys(sub, f"{prefix}{spelling}.")
    return keys


KNOWN_KEYS = sorted(set(
    _known_keys(RaydeepConfig)
    + list(UNSUPPORTED) + ["bfloat16"]
    + [f"zero_optimization.{k}" for k in DEPRECATED_ZERO_KEYS] + ["zero_optimization.cpu_offload_use_pin_memory"]
    + [f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad",
                                         "adam_w_mode", "torch_adam", "bias_correction", "freeze_step",
                                         "comm_backend_name", "max_grad_norm", "max_coeff")]
    + [f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                         "total_num_steps", "cycle_min_lr", "cycle_max_lr", "cos_min_ratio",
                                         "step_size", "gamma")]
))

NAMES = ["Adam", "AdamW", "adamw", "Lamb", "Lion", "SGD", "sgd", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon",
         "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "StepLR", "warmuplr",
         "cpu", "nvme", "none", "fp32", "fp16", "bf16", "bfloat16", "float", "mean", "sum", "Fail", "param"]

SCALARS = {
    "string": st.one_of(st.sampled_from(["auto", "", "true", "1", "5e8", "1e9", "nan"] + NAMES),
                        st.text(max_size=8)),
    "negative": st.one_of(st.integers(-(2**40), -1), st.floats(-1e12, -1e-9, allow_nan=False)),
    "int": st.one_of(st.integers(0, 64), st.sampled_from([1000, 2**31, 5 * 10**8, 10**9]),
                     st.integers(-(2**63), 2**63)),
    "float": st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                       st.sampled_from([0.0, 0.5, 1.0, 1.5, 5e8, 1e-300, 1e300])),
    "bool": st.booleans(),
    "null": st.none(),
}
JSON_SCALARS = st.one_of(*SCALARS.values())
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3),
    max_leaves=6,
)
CONTAINERS = {"list": st.lists(JSON_VALUES, max_size=3),
              "dict": st.dictionaries(st.text(min_size=1, max_size=8), JSON_VALUES, max_size=3)}


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "negative" if value < 0 else "int"
    if isinstance(value, float):
        return "negative" if value < 0 else "float"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "dict"


def _paths(node, prefix=()) -> list[tuple]:
    """Every path (tuple of dict keys / list indexes) to a value inside ``node``."""
    found = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found.append(prefix + (key,))
        found += _paths(value, prefix + (key,))
    return found


def _containers(node, prefix=()) -> list[tuple]:
    """Paths of every dict inside ``node`` (``()`` is the top level)."""
    found = [prefix] if isinstance(node, dict) else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found += _containers(value, prefix + (key,))
    return found


def _at(node, path):
    for key in path:
        node = node[key]
    return node


def _misspell(key: str, draw) -> str:
    how = draw(st.sampled_from(["drop", "swap", "double", "insert", "upper", "prefix", "suffix", "dash"]))
    i = draw(st.integers(0, max(len(key) - 1, 0)))
    if how == "drop" and len(key) > 1:
        out = key[:i] + key[i + 1:]
    elif how == "swap" and len(key) > 1:
        i = min(i, len(key) - 2)
        out = key[:i] + key[i + 1] + key[i] + key[i + 2:]
    elif how == "double":
        out = key[:i] + key[i] + key[i:]
    elif how == "insert":
        out = key[:i] + draw(st.sampled_from("aeiosx_")) + key[i:]
    elif how == "upper":
        out = key.upper()
    elif how == "prefix":
        out = draw(st.sampled_from(["stage3_", "zero_", "ds_", "train_"])) + key
    elif how == "suffix":
        out = key + draw(st.sampled_from(["s", "_size", "_enabled", "_gpu"]))
    else:
        out = key.replace("_", "-")
    return out if out and out != key else key + "x"


def _delete(draw, cfg: dict) -> str:
    paths = [p for p in _paths(cfg) if isinstance(_at(cfg, p[:-1]), dict)]
    if not paths:
        return "delete: nothing"
    path = draw(st.sampled_from(paths))
    del _at(cfg, path[:-1])[path[-1]]
    return f"delete {path}"


def _add_misspelled(draw, cfg: dict) -> str:
    where = draw(st.sampled_from(_containers(cfg)))
    node = _at(cfg, where)
    if node and draw(st.booleans()):
        original = draw(st.sampled_from(sorted(node)))
        key, value = _misspell(original, draw), copy.deepcopy(node[original])
        if draw(st.booleans()):
            del node[original]  # renamed rather than added
    else:
        key, value = draw(st.text(min_size=1, max_size=12)), draw(JSON_VALUES)
    node[key] = value
    return f"add {where + (key,)} = {value!r}"


def _retype(draw, cfg: dict) -> str:
    paths = _paths(cfg)
    if not paths:
        return "retype: nothing"
    path = draw(st.sampled_from(paths))
    kinds = [k for k in (*SCALARS, *CONTAINERS) if k != _kind(_at(cfg, path))]
    kind = draw(st.sampled_from(kinds))
    value = draw(SCALARS[kind] if kind in SCALARS else CONTAINERS[kind])
    _at(cfg, path[:-1])[path[-1]] = value
    return f"retype {path} = {value!r}"


def _set_known(draw, cfg: dict) -> str:
    dotted = draw(st.sampled_from(KNOWN_KEYS))
    value = draw(JSON_VALUES)
    node = cfg
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return f"set {dotted} = {value!r}"


def _set_auto(draw, cfg: dict) -> str:
    paths = _paths(cfg)
    if not paths:
        return "auto: nothing"
    path = draw(st.sampled_from(paths))
    _at(cfg, path[:-1])[path[-1]] = "auto"
    return f"auto {path}"


MUTATIONS = [_delete, _add_misspelled, _retype, _set_known, _set_auto]


@st.composite
def mutated_configs(draw) -> tuple[str, dict, int, list[str]]:
    """(corpus file, mutated config, world size, what was done)."""
    name = draw(st.sampled_from(sorted(BASES)))
    cfg = copy.deepcopy(BASES[name])
    done = [draw(st.sampled_from(MUTATIONS))(draw, cfg) for _ in range(draw(st.integers(1, 3)))]
    world = draw(st.sampled_from([CORPUS[name].world_size, CORPUS[name].world_size, 1, 2, 3, 8, 64]))
    return name, cfg, world, done


def assert_user_error(exc: ConfigError) -> None:
    """A ConfigError names a non-empty key, and the message shows that key."""
    text = str(exc)
    assert isinstance(exc.key, str) and exc.key, f"empty key in {text!r}"
    parts = exc.errors if isinstance(exc, ConfigErrors) else [exc]
    assert parts
    for part in parts:
        assert isinstance(part, ConfigError)
        assert isinstance(part.key, str) and part.key, f"empty key in {str(part)!r}"
        assert part.key in str(part), (part.key, str(part))
        assert part.key in text, (part.key, text)


def check_load(cfg: dict, world: int) -> RaydeepConfig | None:
    try:
        result = load_config(cfg, world_size=world)
    except ConfigError as exc:
        assert_user_error(exc)
        return None
    assert isinstance(result, RaydeepConfig)
    batch = (result.train_batch_size, result.train_micro_batch_size_per_gpu, result.gradient_accumulation_steps)
    assert all(type(v) is int and v > 0 for v in batch), batch
    assert batch[0] == batch[1] * batch[2] * world
    json.dumps(result.to_ds_dict())  # what `config check --json` prints
    return result


@pytest.mark.parametrize("name", sorted(BASES))
def test_unmutated_bases_load(name):
    assert check_load(copy.deepcopy(BASES[name]), CORPUS[name].world_size) is not None


@PROPERTY_SETTINGS
@given(mutated_configs())
def test_mutated_config_loads_or_names_the_key(case):
    _name, cfg, world, _done = case
    check_load(cfg, world)


@CLI_SETTINGS
@given(case=mutated_configs(), use_json=st.booleans())
def test_cli_exit_codes_on_mutated_files(capsys, tmp_path_factory, case, use_json):
    _name, cfg, world, _done = case
    path = Path(tmp_path_factory.mktemp("mutated")) / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    capsys.readouterr()  # drop what earlier examples printed
    argv = ["config", "check", str(path), "--world-size", str(world)] + (["--json"] if use_json else [])
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("error:"), err
    elif use_json:
        resolved = json.loads(out)
        assert type(resolved["train_batch_size"]) is int


# Inputs the search above found (or that sit next to them) which once escaped as a non-ConfigError
# or as a ConfigError with an empty key: pinned so they stay user errors.
KNOWN_CRASHES = [
    pytest.param({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 0}, 4, id="micro-batch-0"),
    pytest.param({"train_batch_size": 8, "gradient_accumulation_steps": 0}, 1, id="grad-accum-0"),
    pytest.param({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": False}, 1, id="micro-batch-false"),
    pytest.param({"train_batch_size": 65536, "train_micro_batch_size_per_gpu": 0.0}, 64, id="micro-batch-0.0"),
    pytest.param({"train_batch_size": 8, "scheduler": {"type": "LRScheduler", "params": {}}}, 1,
                 id="scheduler-LRScheduler"),
    pytest.param({"train_batch_size": 8, "scheduler": {"type": "Optimizer", "params": {}}}, 1,
                 id="scheduler-Optimizer"),
    pytest.param({"elasticity": {"enabled": True, "max_train_batch_size": 1024, "micro_batch_sizes": [4, 8],
                                 "num_gpus_per_node": 8, "model_parallel_size": 2, "version": 0.2}}, 1,
                 id="elasticity-v02-dp0"),
    pytest.param({"elasticity": {"enabled": True, "max_train_batch_size": 1024, "micro_batch_sizes": [4, 8],
                                 "num_gpus_per_node": 49, "version": 0.2}}, 1,
                 id="elasticity-v02-float-dp"),
    pytest.param({"elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [4],
                                 "version": 0.2}}, 4,
                 id="elasticity-v02-batch-0"),
    pytest.param({"": 1, "train_batch_size": 8}, 1, id="empty-key"),
    pytest.param({"train_batch_size": 8, "zero_optimization": {"": 1}}, 1, id="empty-nested-key"),
    pytest.param({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"": 1}}}, 1,
                 id="empty-optimizer-param"),
    pytest.param({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"": 1}}}, 1,
                 id="empty-scheduler-param"),
]


@pytest.mark.parametrize("cfg, world", KNOWN_CRASHES)
def test_known_crashes(cfg, world):
    check_load(cfg, world)
