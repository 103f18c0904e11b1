"""The ``raydeep`` command line: exit codes and messages of ``config check`` and ``estimate``.

A user mistake exits with status 2 and one "error: ..." paragraph on stderr naming the key;
a traceback is a bug. Commands run in-process through ``raydeep.cli.main``.
"""
from __future__ import annotations

import codecs
import json
import re
import subprocess
import sys

import pytest

from raydeep.cli import main

VALID = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}

HF_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9},
}
HF_SETS = ["train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2", "gradient_clipping=1.0",
           "optimizer.params.lr=3e-5", "optimizer.params.weight_decay=0.0", "bf16.enabled=true"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``raydeep ARGV...`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, text: str, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


# --- config check ---------------------------------------------------------------------------------

def test_valid_file(tmp_path, capsys):
    path = write(tmp_path, json.dumps(VALID))
    code, out, err = run(capsys, "config", "check", path, "--world-size", "2")
    assert code == 0, err
    assert "valid for world size 2" in out
    assert "train_batch_size=32 = micro 4 x accumulation 4 x world 2" in out
    assert "zero stage 2, precision bf16" in out
    assert "error" not in err


@pytest.mark.parametrize("config, dotted, guess", [
    ({**VALID, "zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com",
     "overlap_comm"),
    ({**VALID, "gradient_clip": 1.0}, "gradient_clip", "gradient_clipping"),
    ({**VALID, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
])
def test_typo_names_the_dotted_key_and_suggests(tmp_path, capsys, config, dotted, guess):
    path = write(tmp_path, json.dumps(config))
    code, _, err = run(capsys, "config", "check", path, "--world-size", "2")
    assert_user_error(code, err, dotted, "did you mean", repr(guess))


def test_missing_file(tmp_path, capsys):
    missing = str(tmp_path / "no_such_ds_config.json")
    code, out, err = run(capsys, "config", "check", missing)
    assert_user_error(code, err, "no_such_ds_config.json", "existing")
    assert out == ""


@pytest.mark.parametrize("text", [
    '{"train_batch_size": 8,, }',
    '{"train_batch_size": 8, "zero_optimization": {"stage": 2}',
    '{"train_batch_size": [8}',
])
def test_invalid_json(tmp_path, capsys, text):
    path = write(tmp_path, text)
    code, _, err = run(capsys, "config", "check", path)
    assert_user_error(code, err, path, "not valid JSON/HJSON")


@pytest.mark.parametrize("text, key", [
    ('{"train_batch_size": 8, "gradient_clipping": 1.0, "train_batch_size": 16}', "train_batch_size"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "stage": 3}}', "stage"),
])
def test_duplicate_keys(tmp_path, capsys, text, key):
    path = write(tmp_path, text)
    code, _, err = run(capsys, "config", "check", path)
    assert_user_error(code, err, "Duplicate keys in DeepSpeed config", repr(key))


def test_hjson_comments_are_accepted(tmp_path, capsys):
    text = '// DeepSpeed reads ds_config files with hjson\n{\n  "train_batch_size": 8, # eight\n}\n'
    code, out, err = run(capsys, "config", "check", write(tmp_path, text, "commented.hjson"))
    assert code == 0, err
    assert "train_batch_size=8" in out


def test_unresolved_auto_lists_every_key(tmp_path, capsys):
    path = write(tmp_path, json.dumps(HF_AUTO))
    code, _, err = run(capsys, "config", "check", path, "--world-size", "4")
    assert_user_error(code, err, '"auto" is not resolved', "--set")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                "optimizer.params.lr", "optimizer.params.weight_decay"):
        assert key in err
    assert "per_device_train_batch_size" in err  # where Hugging Face would fill it from


def test_set_resolves_auto(tmp_path, capsys):
    path = write(tmp_path, json.dumps(HF_AUTO))
    sets = [arg for item in HF_SETS for arg in ("--set", item)]
    code, out, err = run(capsys, "config", "check", path, "--world-size", "4", *sets)
    assert code == 0, err
    assert "train_batch_size=32 = micro 4 x accumulation 2 x world 4" in out
    assert "zero stage 3, precision bf16" in out
    # "auto" inside zero_optimization is dropped to DeepSpeed's default, with a warning.
    assert "warning: zero_optimization.reduce_bucket_size" in err


def test_set_overrides_a_file_value(tmp_path, capsys):
    path = write(tmp_path, json.dumps(VALID))
    code, out, err = run(capsys, "config", "check", path, "--world-size", "2", "--set", "zero_optimization.stage=3",
                         "--set", "train_batch_size=64", "--json")
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["zero_optimization"]["stage"] == 3
    assert resolved["gradient_accumulation_steps"] == 8


@pytest.mark.parametrize("item, needle", [
    ("train_micro_batch_size_per_gpu", "dotted.key=VALUE"),
    ("=4", "needs a key"),
    ("optimizer.type.name=1", "cannot set a key inside"),
    ("", "'' (empty key): an override must look like dotted.key=VALUE"),
    ("zero_optimization.=1", "zero_optimization.'' (empty key): unknown key"),
])
def test_bad_set(tmp_path, capsys, item, needle):
    path = write(tmp_path, json.dumps(VALID))
    code, _, err = run(capsys, "config", "check", path, "--set", item)
    assert_user_error(code, err, needle)


def test_json_output(tmp_path, capsys):
    path = write(tmp_path, json.dumps(HF_AUTO))
    sets = [arg for item in HF_SETS for arg in ("--set", item)]
    code, out, err = run(capsys, "config", "check", path, "--world-size", "8", "--json", *sets)
    assert code == 0, err
    resolved = json.loads(out)  # stdout is only the JSON; warnings go to stderr
    batch = [resolved[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                   "gradient_accumulation_steps")]
    assert batch == [64, 4, 2] and all(type(v) is int for v in batch)
    assert resolved["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.0},
                                     "legacy_fusion": False}
    zero = resolved["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True
    assert zero["reduce_bucket_size"] == 500_000_000  # the dropped "auto"
    assert zero["stage3_max_live_parameters"] == 1_000_000_000 and type(zero["stage3_max_live_parameters"]) is int
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert resolved["gradient_clipping"] == 1.0


def test_batch_mismatch_names_the_fix(tmp_path, capsys):
    path = write(tmp_path, json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                       "gradient_accumulation_steps": 4}))
    code, _, err = run(capsys, "config", "check", path, "--world-size", "4")
    assert_user_error(code, err, "train_batch_size", "32 != 4 * 4 * 4", "set train_batch_size to 64")


def test_world_size_must_be_positive(tmp_path, capsys):
    code, _, err = run(capsys, "config", "check", write(tmp_path, json.dumps(VALID)), "--world-size", "0")
    assert_user_error(code, err, "world_size")


def test_python_module_entry_point(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8, "gradient_clip": 1.0}')
    proc = subprocess.run([sys.executable, "-m", "raydeep", "config", "check", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: gradient_clip")
    assert "Traceback" not in proc.stderr


# --- estimate -------------------------------------------------------------------------------------

# The ZeRO paper's Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12).
PAPER_TOTALS_GB = {0: "120", 1: "31.4", 2: "16.6", 3: "1.9"}


@pytest.mark.parametrize("stage, printed", sorted(PAPER_TOTALS_GB.items()))
def test_estimate_prints_the_paper_totals(capsys, stage, printed):
    code, out, err = run(capsys, "estimate", "--params", "7.5e9", "--world-size", "64", "--stage", str(stage),
                         "--precision", "fp16")
    assert code == 0, err
    assert "GB" in out
    total_line = next(line for line in out.splitlines() if line.lower().startswith("total"))
    value = float(re.findall(r"\d+(?:\.\d+)?", total_line)[-1])
    assert round(value, 1) == float(printed), total_line


@pytest.mark.parametrize("stage, printed", sorted(PAPER_TOTALS_GB.items()))
def test_estimate_api_totals(stage, printed):
    from raydeep.estimate import estimate_model_states

    est = estimate_model_states(7_500_000_000, 64, stage, precision="fp16", offload_optimizer=False,
                                include_buffers=False)
    assert round(est.total / 1e9, 1) == float(printed)
    assert est.total == pytest.approx(7.5e9 * {0: 16, 1: 4 + 12 / 64, 2: 2 + 14 / 64, 3: 16 / 64}[stage])
    assert "total" in est.format_table()


def test_estimate_json(capsys):
    code, out, err = run(capsys, "estimate", "--params", "7.5e9", "--world-size", "64", "--stage", "3",
                         "--precision", "fp16", "--json")
    assert code == 0, err
    assert json.loads(out)["total"] == pytest.approx(1.875e9)


@pytest.mark.parametrize("params", ["7.5", "-1", "0"])
def test_estimate_rejects_bad_parameter_counts(capsys, params):
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--params", params, "--world-size", "64", "--stage", "3"])
    assert info.value.code == 2
    assert "not a positive whole number" in capsys.readouterr().err


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be"])
def test_utf16_and_utf8_bom_files_are_read(tmp_path, capsys, encoding):
    # Windows PowerShell's `>` writes UTF-16 with a BOM; Notepad may put a BOM before UTF-8.
    path = tmp_path / "ds_config.json"
    text = '{"train_batch_size": 8, "wandb": {"project": "café"}}'
    path.write_bytes((codecs.BOM_UTF16_BE if encoding == "utf-16-be" else b"") + text.encode(encoding))
    code, out, err = run(capsys, "config", "check", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["wandb"]["project"] == "café"


@pytest.mark.parametrize("data", ['{"train_batch_size": 8, "wandb": {"project": "café"}}'.encode("latin-1"),
                                  b'\xff\xfe{\x00"'])
def test_non_utf8_file_is_a_user_error(tmp_path, capsys, data):
    # Old editors save Latin-1; a truncated UTF-16 file does not decode either.
    path = tmp_path / "ds_config.json"
    path.write_bytes(data)
    code, _, err = run(capsys, "config", "check", str(path))
    assert_user_error(code, err, str(path), "save the file as UTF-8")
