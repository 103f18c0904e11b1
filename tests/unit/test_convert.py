"""``raydeep convert`` without an engine: export, offline reshard, DeepSpeed import from synthetic
files, and bad input (one ``error:`` line naming the file or key, exit status 2)."""
from __future__ import annotations

import enum
import json
import math
import os
import shutil
import sys
import types

import pytest
import torch

from raydeep.checkpoint import CheckpointReader, write_single
from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.convert import main as convert
from raydeep.checkpoint.deepspeed_import import import_deepspeed
from raydeep.checkpoint.safe_torch_load import safe_load
from raydeep.checkpoint.export import consolidated_state_dict, load_consolidated, parse_size
from raydeep.errors import CheckpointError

WEIGHTS = {"emb.weight": torch.randn(10, 6, generator=torch.Generator().manual_seed(0)),
           "head.bias": torch.arange(5.0), "head.weight": torch.linspace(-1, 1, 35).view(5, 7)}
EXTRA = {"buffer/positions": torch.arange(4), "buffer/scale": torch.tensor([0.5, 2.0]),
         "frozen/norm.weight": torch.ones(3)}


@pytest.fixture
def ckpt(tmp_path):
    directory = tmp_path / "run"
    states = {"exp_avg": {n: w * 2 for n, w in WEIGHTS.items()}, "exp_avg_sq": {n: w * w for n, w in WEIGHTS.items()}}
    write_single(str(directory), "global_step7", WEIGHTS, states=states, extra=EXTRA, counters={"global_steps": 7})
    return str(directory)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = convert(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- export -------------------------------------------------------------------------------------------
def test_consolidated_equals_reader_full_with_buffers_and_frozen(ckpt, tmp_path, capsys):
    code, out, _ = run(capsys, "export", ckpt, str(tmp_path / "out"))
    assert code == 0 and "model.safetensors" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    loaded = load_consolidated(str(tmp_path / "out"))
    reader = CheckpointReader.open(ckpt)
    assert set(loaded) == set(WEIGHTS) | {"positions", "scale", "norm.weight"}
    for name in WEIGHTS:
        assert torch.equal(loaded[name], reader.full("fp32", name)) and loaded[name].dtype == torch.float32
    assert torch.equal(loaded["positions"], EXTRA["buffer/positions"])
    assert torch.equal(loaded["norm.weight"], EXTRA["frozen/norm.weight"])
    from_file = load_consolidated(str(tmp_path / "out" / "model.safetensors"))
    assert from_file.keys() == loaded.keys() and all(torch.equal(from_file[k], loaded[k]) for k in loaded)


def test_sharded_export_writes_an_index(ckpt, tmp_path, capsys):
    # 240 + 20 + 140 bytes of weights and 52 of buffers/frozen: 200-byte shards need several files.
    code, out, _ = run(capsys, "export", ckpt, str(tmp_path / "out"), "--max-shard-size", "200B",
                       "--format", "safetensors", "--format", "torch")
    assert code == 0
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and "pytorch_model.bin.index.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s in files for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    full = consolidated_state_dict(CheckpointReader.open(ckpt))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    for source in ("out", "out/model.safetensors.index.json", "out/pytorch_model.bin.index.json"):
        loaded = load_consolidated(str(tmp_path / source))
        assert list(loaded) == list(full) and all(torch.equal(loaded[k], full[k]) for k in full), source
    # Exporting again unsharded replaces the shards and their index instead of leaving them stale.
    assert run(capsys, "export", ckpt, str(tmp_path / "out"))[0] == 0
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.startswith("model")) == ["model.safetensors"]


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_cast_keeps_integer_buffers(ckpt, tmp_path, capsys, dtype, torch_dtype):
    assert run(capsys, "export", ckpt, str(tmp_path / "out"), "--dtype", dtype)[0] == 0
    loaded = load_consolidated(str(tmp_path / "out"))
    assert loaded["head.weight"].dtype == torch_dtype
    assert torch.equal(loaded["head.weight"], WEIGHTS["head.weight"].to(torch_dtype))
    assert loaded["scale"].dtype == torch_dtype and loaded["positions"].dtype == torch.int64


def test_torch_format_loads_with_weights_only(ckpt, tmp_path, capsys):
    assert run(capsys, "export", ckpt, str(tmp_path / "out"), "--format", "torch")[0] == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["pytorch_model.bin"]
    state_dict = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state_dict["emb.weight"], WEIGHTS["emb.weight"])
    assert set(state_dict) == set(load_consolidated(str(tmp_path / "out")))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5 MB") == 1_500_000 and parse_size("2GiB") == 2**31
    assert parse_size("123") == 123
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(CheckpointError, match="size"):
            parse_size(bad)


# --- reshard ------------------------------------------------------------------------------------------
def test_reshard_splits_every_state_evenly(ckpt, tmp_path, capsys):
    code, out, _ = run(capsys, "reshard", ckpt, str(tmp_path / "three"), "--world-size", "3")
    assert code == 0 and "3 rank files" in out
    original, resharded = CheckpointReader.open(ckpt), CheckpointReader.open(str(tmp_path / "three"))
    resharded.verify_all()
    assert resharded.tag == "global_step7" and resharded.manifest["world_size"] == 3
    total = sum(w.numel() for w in WEIGHTS.values())
    share = math.ceil(total / 3)
    for rank in range(3):
        pieces = resharded.manifest["files"][fmt.rank_file(rank, 3)]["pieces"]
        assert sum(end - start for _, start, end, _ in pieces) == min(share, total - rank * share)
    for kind in original.state_kinds:
        for name in WEIGHTS:
            assert torch.equal(original.full(kind, name), resharded.full(kind, name))
    assert resharded.extra().keys() == original.extra().keys()
    assert resharded.manifest["counters"] == original.manifest["counters"]


# --- bad input ----------------------------------------------------------------------------------------
def test_not_a_checkpoint_and_missing_files(ckpt, tmp_path, capsys):
    code, _, err = run(capsys, "export", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert code == 2 and err.startswith("error: ") and "nothing/latest does not exist" in err
    code, _, err = run(capsys, "export", ckpt, str(tmp_path / "out"), "--max-shard-size", "lots")
    assert code == 2 and "'lots'" in err
    os.remove(os.path.join(ckpt, "global_step7", fmt.rank_file(0, 1)))
    code, _, err = run(capsys, "export", ckpt, str(tmp_path / "out"))
    assert code == 2 and fmt.rank_file(0, 1) in err and "missing" in err
    code, _, err = run(capsys, "reshard", ckpt, str(tmp_path / "out"), "--world-size", "0")
    assert code == 2 and "--world-size" in err
    with pytest.raises(CheckpointError, match="holds no exported weights"):
        load_consolidated(str(tmp_path))


def test_import_refuses_what_is_not_a_deepspeed_checkpoint(ckpt, tmp_path, capsys):
    code, _, err = run(capsys, "import-deepspeed", ckpt, str(tmp_path / "out"))
    assert code == 2 and "no *_optim_states.pt files" in err
    code, _, err = run(capsys, "import-deepspeed", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert code == 2 and "is not a directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "import-deepspeed", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "no 'latest' file" in err


# --- DeepSpeed import from synthetic files ------------------------------------------------------------
# Files shaped like DeepSpeed 0.19.8's (see raydeep.checkpoint.deepspeed_import), pickled with
# stand-in classes registered under DeepSpeed's module names so that deepspeed is not needed.
class _ZeroStageEnum(int, enum.Enum):
    __module__, __qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"
    optimizer_states = 1
    gradients = 2
    weights = 3


class _DynamicLossScaler:
    __module__, __qualname__ = "deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"

    def __init__(self):
        self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_factor = 1024.0, 9, 4, 2.0
        self.scale_window, self.min_scale, self.delayed_shift, self.cur_hysteresis = 100, 1, 2, 1
        self.consecutive_hysteresis, self.raise_error_at_min_scale, self.dynamic = False, True, True


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """Register the stand-ins as deepspeed.runtime.*, as the pickles of real files name them."""
    classes = {"deepspeed.runtime.zero.config": _ZeroStageEnum,
               "deepspeed.runtime.fp16.loss_scaler": _DynamicLossScaler}
    for name in ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.fp16", *classes]:
        module = types.ModuleType(name)
        if name in classes:
            setattr(module, classes[name].__qualname__, classes[name])
        monkeypatch.setitem(sys.modules, name, module)


# A model of 3 parameters (one tied alias, one frozen) and a buffer; world size 2.
SHAPES = {"a.weight": (3, 3), "b.bias": (5,)}  # 9 + 5 = 14 elements: stage 2 pads to 16
FROZEN = torch.tensor([7.0, 8.0, 9.0])
BUFFER = torch.tensor([1, 2, 3])


def _flat(values: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([values[n].reshape(-1) for n in SHAPES])


def _write_deepspeed(directory, stage: int, masters: dict, moments: dict, fp16: bool = True) -> None:
    tag = directory / "global_step4"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("global_step4")
    config = {"train_batch_size": 8, "fp16": {"enabled": fp16}, "zero_optimization": {"stage": stage}}
    module = {n: (masters[n].half() if stage < 3 else torch.empty(0, dtype=torch.half)) for n in SHAPES}
    module.update({"tied.weight": module["a.weight"], "frozen.weight": FROZEN.half(), "buf": BUFFER})
    model = {"module": module, "buffer_names": ["buf"], "optimizer": None,
             "param_shapes": [{n: torch.Size(s) for n, s in SHAPES.items()}],
             "frozen_param_shapes": {"frozen.weight": torch.Size([3])} if stage == 3 else None,
             "shared_params": {"tied.weight": "a.weight"}, "lr_scheduler": {"last_batch_iteration": 3},
             "skipped_steps": 1, "global_steps": 4, "global_samples": 32, "dp_world_size": 2, "mp_world_size": 1,
             "ds_config": config, "ds_version": "0.19.8", "note": "hi", "marker": torch.arange(2)}
    for rank in range(2):
        group = {"lr": 0.5, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "foreach": None, "fused": None,
                 "params": [0]}
        if stage == 3:  # per parameter: ceil(numel / 2) elements of each rank, zero-padded
            def part(values):
                pieces = []
                for n, s in SHAPES.items():
                    flat = values[n].reshape(-1)
                    size = math.ceil(flat.numel() / 2)
                    padded = torch.nn.functional.pad(flat, (0, 2 * size - flat.numel()))
                    pieces.append(padded[rank * size:(rank + 1) * size])
                return torch.cat(pieces)
            state = {"step": torch.tensor(4.0), "exp_avg": part(moments)}
            osd = {"zero_stage": _ZeroStageEnum.weights, "loss_scaler": _DynamicLossScaler(), "partition_count": 2,
                   "optimizer_state_dict": {"state": {0: state}, "param_groups": [group]},
                   "fp32_flat_groups": [part(masters)]}
            frozen = torch.nn.functional.pad(FROZEN.half(), (0, 1))[rank * 2:(rank + 1) * 2]
            torch.save({**model, "frozen_param_fragments": {"frozen.weight": frozen}},
                       tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        else:  # one flat group padded to 16 and split in two; the fp32 partition is saved without padding
            lean = _flat(masters)[rank * 8:(rank + 1) * 8]
            padded = torch.nn.functional.pad(_flat(moments), (0, 2))[rank * 8:(rank + 1) * 8]
            state = {"step": torch.tensor(4.0), "exp_avg": padded}
            osd = {"zero_stage": _ZeroStageEnum.gradients, "loss_scaler": _DynamicLossScaler(),
                   "base_optimizer_state": {"state": {0: state}, "param_groups": [group]},
                   "single_partition_of_fp32_groups": [lean], "group_paddings": [2 * rank],
                   "param_alignment_paddings": [[0, 0]], "partition_count": [2]}
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    if stage < 3:
        torch.save(model, tag / "mp_rank_00_model_states.pt")


@pytest.mark.parametrize("stage", [2, 3])
def test_import_synthetic_deepspeed_checkpoint(tmp_path, fake_deepspeed, monkeypatch, capsys, stage):
    masters = {n: torch.arange(math.prod(s), dtype=torch.float32).view(s) + 100 * i
               for i, (n, s) in enumerate(SHAPES.items())}
    moments = {n: -m for n, m in masters.items()}
    _write_deepspeed(tmp_path / "ds", stage, masters, moments)
    for name in [n for n in sys.modules if n.split(".")[0] == "deepspeed"]:
        monkeypatch.delitem(sys.modules, name)  # the import itself must not need any DeepSpeed class
    code, out, err = run(capsys, "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "rd"))
    assert code == 0, err
    reader = CheckpointReader.open(str(tmp_path / "rd"))
    assert reader.tag == "global_step4" and list(reader.params) == list(SHAPES)
    for name in SHAPES:
        assert torch.equal(reader.full("fp32", name), masters[name])
        assert torch.equal(reader.full("exp_avg", name), moments[name])
    manifest = reader.manifest
    assert manifest["source"] == "deepspeed" and manifest["stage"] == stage and manifest["precision"] == "fp16"
    assert manifest["counters"] == {"global_steps": 4, "global_samples": 32, "skipped_steps": 1}
    assert manifest["optimizer"]["scalars"] == [{"step": {"value": 4.0, "dtype": "float32", "tensor": True,
                                                          "on_param_device": True}}]
    assert manifest["param_groups"] == [{"lr": 0.5, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}]
    assert manifest["lr_scheduler"] == {"last_batch_iteration": 3}
    assert manifest["loss_scaler"]["type"] == "dynamic" and manifest["loss_scaler"]["cur_scale"] == 1024.0
    assert manifest["loss_scaler"]["cur_iter"] == 9 and manifest["client_state"] == {"note": "hi"}
    extra = reader.extra()
    assert torch.equal(extra["client/marker"], torch.arange(2)) and torch.equal(extra["buffer/buf"], BUFFER)
    assert torch.equal(extra["frozen/frozen.weight"], FROZEN.half()) and "frozen/tied.weight" not in extra


def test_missing_and_mismatched_deepspeed_files(tmp_path, fake_deepspeed, capsys):
    masters = {n: torch.ones(s) for n, s in SHAPES.items()}
    _write_deepspeed(tmp_path / "ds", 2, masters, masters)
    tag = tmp_path / "ds" / "global_step4"
    os.rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path / "rank1.pt")
    code, _, err = run(capsys, "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "rd"))
    assert code == 2 and "partition_count is 2 but there are 1" in err
    os.rename(tmp_path / "rank1.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    code, _, err = run(capsys, "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "rd"))
    assert code == 2 and "rank(s) [1] are missing" in err
    os.rename(tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"truncated")
    code, _, err = run(capsys, "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "rd"))
    assert code == 2 and "zero_pp_rank_0_mp_rank_00_optim_states.pt: not a readable torch.save file" in err
    os.remove(tag / "mp_rank_00_model_states.pt")
    code, _, err = run(capsys, "import-deepspeed", str(tag), str(tmp_path / "rd"))
    assert code == 2 and "model states file missing" in err
    assert not (tmp_path / "rd").exists()


class _Hostile:
    """Unpickling this with full pickle would delete ``victim``."""

    def __init__(self, victim):
        self.victim = str(victim)

    def __reduce__(self):
        return (shutil.rmtree, (self.victim,))


def test_loading_never_runs_code_from_the_file(tmp_path):
    victim = tmp_path / "precious"
    victim.mkdir()
    torch.save({"optimizer_state_dict": _Hostile(victim)}, tmp_path / "evil.pt")
    loaded = safe_load(str(tmp_path / "evil.pt"))  # shutil.rmtree becomes an inert stand-in
    assert victim.exists() and type(loaded["optimizer_state_dict"]).source == "shutil.rmtree"
    tag = tmp_path / "ds" / "t"
    tag.mkdir(parents=True)
    os.replace(tmp_path / "evil.pt", tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="optimizer_state_dict: expected a dict, found rmtree"):
        import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "rd"), tag="t")
    assert victim.exists()
    # torch refuses some modules (os, sys, subprocess...) outright, even as stand-ins.
    torch.save({"x": _System()}, tmp_path / "system.pt")
    with pytest.raises(CheckpointError, match=r"system.pt: cannot be loaded safely \(UnpicklingError: .*GLOBAL"):
        safe_load(str(tmp_path / "system.pt"))


class _System:
    def __reduce__(self):
        return (os.system, ("exit 3",))


def test_raydeep_command_dispatches_convert(ckpt, tmp_path, capsys):
    from raydeep.cli import main as raydeep_main

    assert raydeep_main(["convert", "export", ckpt, str(tmp_path / "cli"), "--dtype", "bf16"]) == 0
    assert load_consolidated(str(tmp_path / "cli"))["head.weight"].dtype == torch.bfloat16
    assert raydeep_main(["convert", "export", str(tmp_path / "nothing-here"), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.count("error:") == 1
