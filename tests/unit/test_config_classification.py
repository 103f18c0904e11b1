"""Every field of the config model is honoured, warned about, or refused -- and the table says which.

The fields are found by walking ``RaydeepConfig`` and its nested sections here, independently of
``raydeep.config.support``, so a field added to the model without an entry in ``SUPPORT`` fails
``test_every_field_has_exactly_one_classification``.
"""
from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from raydeep.config import load_config
from raydeep.config.model import RaydeepConfig
from raydeep.config.support import HONOURED, REFUSED, SUPPORT, WARNED
from raydeep.errors import ConfigError, ConfigErrors

REPO = Path(__file__).resolve().parents[2]


def _section(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [s for arg in typing.get_args(annotation) if (s := _section(arg)) is not None]
        return found[0] if found else None
    return None


def model_fields(model: type[BaseModel] = RaydeepConfig, prefix: str = "") -> dict[str, tuple[type[BaseModel], str]]:
    """Dotted path of every leaf field -> (the section class holding it, the field name)."""
    found = {}
    for name, info in model.model_fields.items():
        sub = _section(info.annotation)
        if sub is None:
            found[prefix + name] = (model, name)
        else:
            found.update(model_fields(sub, f"{prefix}{name}."))
    return found


FIELDS = model_fields()
BY_STATUS = {status: sorted(p for p, e in SUPPORT.items() if e.status == status)
             for status in (HONOURED, WARNED, REFUSED)}


def _set(data: dict, dotted: str, value) -> None:
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def config_setting(path: str) -> dict:
    """A config that sets ``path`` to its entry's example, with what the example needs to reach it."""
    entry = SUPPORT[path]
    # Elasticity decides the batch itself and refuses batch keys beside it.
    data = {} if path.startswith("elasticity.") else {"train_micro_batch_size_per_gpu": 1}
    section, name = FIELDS[path]
    if "enabled" in section.model_fields and name != "enabled":
        _set(data, path.rsplit(".", 1)[0] + ".enabled", True)  # a switched-off section's fields are skipped
    for dotted, value in entry.needs:
        _set(data, dotted, value)
    _set(data, path, entry.example)
    return data


def test_every_field_has_exactly_one_classification():
    missing = sorted(set(FIELDS) - set(SUPPORT))
    stale = sorted(set(SUPPORT) - set(FIELDS))
    assert not missing, f"classify these fields in raydeep/config/support.py: {missing}"
    assert not stale, f"SUPPORT lists paths that are not fields of the config model: {stale}"
    assert all(e.status in (HONOURED, WARNED, REFUSED) for e in SUPPORT.values())


def test_no_field_is_classified_twice():
    """A dict literal keeps the last of two equal keys silently: count the entries as written."""
    import ast

    from raydeep.config import support

    tree = ast.parse((REPO / "raydeep/config/support.py").read_text())
    table = next(n.value for n in tree.body
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "SUPPORT")
    literal = [k.value for k in table.keys if k is not None]
    assert len(literal) == len(set(literal)), sorted(k for k in literal if literal.count(k) > 1)
    unpacked = [eval(compile(ast.Expression(v), "support.py", "eval"), vars(support))  # noqa: S307 - own source
                for k, v in zip(table.keys, table.values) if k is None]
    assert len(literal) + sum(len(part) for part in unpacked) == len(SUPPORT), "a path is classified twice"


def test_the_table_covers_the_fields_the_user_reported():
    # Offload to NVMe is refused; to the CPU ("cpu" is inert for the refusal) it is honoured.
    for path in ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"):
        assert SUPPORT[path].status == REFUSED and SUPPORT[path].example == "nvme" and "cpu" in SUPPORT[path].inert
    for path in ("zero_optimization.reduce_scatter", "zero_optimization.contiguous_gradients",
                 "zero_optimization.ignore_unused_parameters"):
        assert SUPPORT[path].status != HONOURED, path
    for path in ("zero_optimization.sub_group_size", "zero_optimization.offload_optimizer.pin_memory",
                 "zero_optimization.gather_16bit_weights_on_model_save",  # engine.save_16bit_model
                 "zero_optimization.offload_optimizer.ratio", "raydeep.offload_resource", "raydeep.offload_target"):
        assert SUPPORT[path].status == HONOURED, path


@pytest.mark.parametrize("path", BY_STATUS[HONOURED])
def test_honoured_fields_are_read_where_the_table_says(path):
    entry = SUPPORT[path]
    assert entry.where, f"{path}: an honoured field names the modules that read it"
    name = path.rsplit(".", 1)[-1]
    for module in entry.where:
        source = REPO / module
        assert source.is_file(), f"{path}: {module} does not exist"
        assert name in source.read_text(), f"{path}: {module} never mentions {name!r}"


@pytest.mark.parametrize("path", BY_STATUS[WARNED] + BY_STATUS[REFUSED])
def test_examples_differ_from_the_default(path):
    section, name = FIELDS[path]
    entry = SUPPORT[path]
    assert entry.why, f"{path}: say why"
    assert entry.status == WARNED or entry.fix, f"{path}: a refusal needs a fix"
    assert entry.written or entry.example != section.model_fields[name].get_default(call_default_factory=True)


@pytest.mark.parametrize("path", BY_STATUS[REFUSED])
def test_refused_fields_raise_naming_the_key(path):
    with pytest.raises(ConfigError) as info:
        load_config(config_setting(path))
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    assert path in [e.key for e in errors], str(info.value)
    assert all(e.fix for e in errors if e.key == path)


@pytest.mark.parametrize("path", BY_STATUS[WARNED])
def test_warned_fields_warn_naming_the_key(path):
    cfg = load_config(config_setting(path))
    assert any(w.startswith(f"{path} = ") and "has no effect" in w for w in cfg.warnings), cfg.warnings


@pytest.mark.parametrize("path", [p for p in BY_STATUS[WARNED] + BY_STATUS[REFUSED] if not SUPPORT[p].written])
def test_the_default_written_out_is_silent(path):
    """Writing a field's default value (as templates do) is neither warned about nor refused
    (except for the keys refused whenever written, as DeepSpeed 0.19.8 does)."""
    section, name = FIELDS[path]
    data = config_setting(path)
    _set(data, path, section.model_fields[name].get_default(call_default_factory=True))
    cfg = load_config(data)
    assert not any(w.startswith(f"{path} = ") for w in cfg.warnings), cfg.warnings


def test_a_switched_off_section_is_not_warned_about():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "csv_monitor": {"enabled": False, "output_path": "logs/csv/", "job_name": "x"},
                       "comms_logger": {"enabled": False, "verbose": True}})
    assert not [w for w in cfg.warnings if w.startswith(("csv_monitor", "comms_logger"))]
    assert cfg.comms_logger is None  # the engine logs collectives only for an enabled comms_logger


def test_messages_name_the_spelling_the_user_wrote():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}})
    written = "zero_optimization.stage3_use_all_reduce_for_fetch_params = True"
    assert any(w.startswith(written) for w in cfg.warnings), cfg.warnings
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}})
    assert not [w for w in cfg.warnings if "offload" in w and "deprecated" not in w], cfg.warnings
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "bfloat16": {"enabled": True, "bf16_optimizer_states": True}})
    assert info.value.key == "bfloat16.bf16_optimizer_states"


# --- every message names only things that exist -------------------------------------------------

def _texts() -> list[str]:
    return [t for e in SUPPORT.values() for t in (e.why, e.fix) if t]


def _subcommands(parser) -> dict:
    import argparse

    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def test_commands_named_in_messages_exist():
    import re

    from raydeep.cli import build_parser

    named = {m for text in _texts() for m in re.findall(r"`raydeep ([a-z-]+(?: [a-z-]+)?)", text)}
    assert named, "the table names at least `raydeep estimate`"
    for command in named:
        parser = build_parser()
        for word in command.split():
            choices = _subcommands(parser)
            if not choices:
                break  # the rest are arguments (SRC OUT ...)
            assert word in choices, f"`raydeep {command}` is named in a message but is not a command"
            parser = choices[word]


def test_python_names_in_messages_exist():
    import re

    from raydeep.engine.engine import Engine

    for text in _texts():
        for method in re.findall(r"\bengine\.(\w+)\(", text):
            assert hasattr(Engine, method), f"Engine.{method} is named in {text!r}"
        for dotted in re.findall(r"\braydeep(?:\.\w+)+", text):
            if dotted in SUPPORT:
                continue  # a key of the config's "raydeep" section
            parts = dotted.split(".")
            for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module of the package
                base = REPO.joinpath(*parts[:i])
                source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                if source.is_file():
                    break
            assert parts[-1] in source.read_text(), f"{dotted} is named in {text!r}"


def test_no_message_promises_what_raydeep_lacks():
    """There is no `raydeep tune` command (`raydeep autotune` is the autotuner); MFU is `raydeep train`'s (from the model's FLOPs per
    token), never the engine's; the monitors raydeep writes are tensorboard and csv_monitor."""
    rules = (REPO / "raydeep/config/rules.py").read_text()
    for text in _texts() + [rules]:
        assert "raydeep tune" not in text
        assert "MFU" not in text or "`raydeep train` reports MFU" in text, text
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {"enabled": True},
                       "wandb": {"enabled": True}, "tensorboard": {"enabled": True}})
    by_key = {w.split(" = ")[0]: w for w in cfg.warnings}
    assert "`raydeep autotune CONFIG" in by_key["autotuning.enabled"]
    from raydeep.cli import build_parser

    assert build_parser().parse_args(["autotune", "ds.json"]).func.__module__ == "raydeep.autotune"
    assert "use tensorboard or csv_monitor" in by_key["wandb.enabled"]
    assert "tensorboard.enabled" not in by_key
    with pytest.raises(ConfigError, match="the FLOPs profiler is not implemented in raydeep") as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"enabled": True}})
    assert info.value.key == "flops_profiler.enabled" and "MFU" in info.value.fix


def test_docs_table_is_the_code_table():
    from raydeep.config.support import support_table

    docs = (REPO / "docs" / "config.md").read_text()
    regenerate = "python -c 'from raydeep.config.support import support_table; print(support_table())'"
    assert support_table() in docs, f"docs/config.md is out of date: replace its table with the output of {regenerate}"
