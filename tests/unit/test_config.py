"""The ds_config system: forms, the batch triangle, "auto", unknown keys, cross-field rules."""
import base64
import json

import pytest

from raydeep.config import load_config
from raydeep.config.batch import derive_batch, elastic_plan, valid_world_sizes
from raydeep.config.sections import ElasticityConfig
from raydeep.errors import ConfigError, ConfigErrors

BASE = {"train_micro_batch_size_per_gpu": 2}


def load(extra=None, **kw):
    return load_config({**BASE, **(extra or {})}, **kw)


def error_of(data, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(data, **kw)
    return info.value


# --- accepted forms ---------------------------------------------------------------------------

def test_dict_json_string_base64_and_file_give_the_same_config(tmp_path):
    data = {"train_batch_size": 16, "zero_optimization": {"stage": 2}}
    text = json.dumps(data)
    path = tmp_path / "ds.json"
    path.write_text(text)
    b64 = base64.urlsafe_b64encode(text.encode()).decode()
    dumps = [load_config(src, world_size=2).to_ds_dict() for src in (data, text, b64, str(path), path)]
    assert all(d == dumps[0] for d in dumps)
    assert dumps[0]["train_micro_batch_size_per_gpu"] == 8


def test_hjson_with_comments(tmp_path):
    path = tmp_path / "ds.hjson"
    path.write_text("""{
      // micro batch per rank
      train_micro_batch_size_per_gpu: 4
      # hash comments too
      zero_optimization: { stage: 3 }  /* block comment */
    }""")
    cfg = load_config(str(path), world_size=2)
    assert cfg.train_batch_size == 8 and cfg.zero_optimization.stage == 3


def test_duplicate_keys_in_a_file_are_rejected(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    err = error_of(str(path))
    assert "Duplicate keys in DeepSpeed config" in str(err) and err.key == "stage"


def test_unusable_string_names_deepspeeds_expectation():
    err = error_of("no/such/file.json")
    assert "Expected a string path to an existing deepspeed config" in str(err)


def test_invalid_json_file_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,, }')
    assert str(path) in str(error_of(str(path)))


# --- batch triangle: every derivation row, DeepSpeed's four checks in order -------------------

@pytest.mark.parametrize("B, m, g, W, expected", [
    (32, 4, 2, 4, (32, 4, 2)),      # all given: only validated
    (32, 4, None, 2, (32, 4, 4)),   # g = (B // m) // W
    (32, None, 2, 2, (32, 8, 2)),   # m = (B // W) // g
    (None, 4, 3, 2, (24, 4, 3)),    # B = m * g * W
    (32, None, None, 4, (32, 8, 1)),  # g = 1, m = B // W
    (None, 4, None, 3, (12, 4, 1)),   # B = m * W, g = 1
])
def test_batch_triangle_rows(B, m, g, W, expected):
    plan = derive_batch(B, m, g, W)
    assert (plan.train_batch_size, plan.micro_batch, plan.grad_accum) == expected


@pytest.mark.parametrize("B, m, g", [(None, None, None), (None, None, 4)])
def test_batch_triangle_needs_batch_or_micro(B, m, g):
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"):
        derive_batch(B, m, g, 2)


def test_floor_division_surfaces_as_the_equality_check():
    with pytest.raises(ConfigError) as info:
        derive_batch(10, 3, None, 1)
    assert ("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            "gradient_acc_step * world_size 10 != 3 * 3 * 1") in str(info.value)
    assert "Fix: set train_batch_size to 9" in str(info.value)


@pytest.mark.parametrize("B, m, g, W, message", [
    (0, 1, 1, 1, "Train batch size: 0 has to be greater than 0"),
    (4, None, None, 8, "Micro batch size per gpu: 0 has to be greater than 0"),
    (8, 16, None, 1, "Gradient accumulation steps: 0 has to be greater than 0"),
])
def test_batch_checks_in_order(B, m, g, W, message):
    with pytest.raises(ConfigError, match=message):
        derive_batch(B, m, g, W)


@pytest.mark.parametrize("data, world, key, message", [
    ({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 0}, 4, "train_micro_batch_size_per_gpu",
     "Micro batch size per gpu: 0 has to be greater than 0"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 0}, 1, "gradient_accumulation_steps",
     "Gradient accumulation steps: 0 has to be greater than 0"),
    ({"train_batch_size": 0, "gradient_accumulation_steps": 0}, 1, "train_batch_size",
     "Train batch size: 0 has to be greater than 0"),
])
def test_a_zero_divisor_fails_deepspeeds_check_instead_of_dividing(data, world, key, message):
    err = error_of(data, world_size=world)
    assert err.key == key and message in str(err)
    assert key == "train_batch_size" or f"Fix: set {key} to a positive integer" in str(err)


# Every batch-triangle error names a key the user wrote; a value raydeep derived is called derived.
@pytest.mark.parametrize("data, world, key, text", [
    ({"train_micro_batch_size_per_gpu": 0, "gradient_accumulation_steps": 1}, 1, "train_micro_batch_size_per_gpu",
     "Micro batch size per gpu: 0 has to be greater than 0"),
    ({"train_micro_batch_size_per_gpu": 0}, 4, "train_micro_batch_size_per_gpu", "Micro batch size per gpu: 0"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": -1}, 1, "gradient_accumulation_steps",
     "Gradient accumulation steps: -1 has to be greater than 0"),
    ({"train_batch_size": 4}, 8, "train_batch_size", "train_micro_batch_size_per_gpu is derived as "
     "train_batch_size // world_size // gradient_accumulation_steps = 4 // 8 // 1"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 16}, 1, "train_batch_size",
     "train_micro_batch_size_per_gpu is derived as"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 16}, 1, "train_batch_size",
     "gradient_accumulation_steps is derived as train_batch_size // train_micro_batch_size_per_gpu // world_size"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": -2}, 1, "gradient_accumulation_steps",
     "Gradient accumulation steps: -2"),
    ({"train_batch_size": -8, "train_micro_batch_size_per_gpu": 2}, 1, "train_batch_size", "Train batch size: -8"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1, "train_batch_size", "10 != 3 * 3 * 1"),
])
def test_batch_errors_name_a_key_the_user_wrote(data, world, key, text):
    err = error_of(data, world_size=world)
    assert err.key == key and text in str(err), str(err)
    assert key in data


@pytest.mark.parametrize("value", [True, False, "8", 8.5, [8]])
@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_batch_keys_are_strict_integers(key, value):
    err = error_of({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                    key: value})
    assert err.key == key


def test_batch_keys_accept_whole_floats():
    cfg = load_config({"train_batch_size": 16.0, "train_micro_batch_size_per_gpu": 4.0}, world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (16, 2)
    assert type(cfg.train_micro_batch_size_per_gpu) is int


def test_triangle_through_load_config_uses_world_size():
    cfg = load_config({"train_batch_size": 64, "gradient_accumulation_steps": 4}, world_size=4)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.world_size) == (4, 4)


# --- "auto" ---------------------------------------------------------------------------------

def test_train_batch_size_auto_is_derived_from_the_other_two():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 2}, world_size=3)
    assert cfg.train_batch_size == 24


def test_auto_in_pydantic_sections_drops_to_default_with_a_warning():
    cfg = load({"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                                   "stage3_prefetch_bucket_size": "auto"}})
    assert cfg.fp16.enabled is False
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000
    assert any("fp16.enabled" in w for w in cfg.warnings)


def test_unresolved_auto_lists_every_key_and_how_to_set_it():
    with pytest.raises(ConfigErrors) as info:
        load({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}}})
    keys = {e.key for e in info.value.errors}
    assert keys == {"gradient_clipping", "optimizer.params.lr", "optimizer.params.eps"}
    assert "--set optimizer.params.lr=VALUE" in str(info.value)


def test_overrides_resolve_auto_from_strings_and_mappings():
    data = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    a = load_config(data, overrides=["train_micro_batch_size_per_gpu=4", "optimizer.params.lr=3e-4"])
    b = load_config(data, overrides={"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 3e-4})
    assert a.to_ds_dict() == b.to_ds_dict()
    assert a.optimizer.params["lr"] == 3e-4 and a.train_batch_size == 4


# --- unknown keys at every level --------------------------------------------------------------

@pytest.mark.parametrize("data, key, guess", [
    ({"gradient_clip": 1.0}, "gradient_clip", "gradient_clipping"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_paramters": 1e9}},
     "zero_optimization.stage3_max_live_paramters", "stage3_max_live_parameters"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw", "loss_scale_window"),
])
def test_typos_get_did_you_mean(data, key, guess):
    err = error_of({**BASE, **data})
    assert err.key == key and f"did you mean {guess!r}" in str(err)


def test_unknown_optimizer_param_is_named():
    err = error_of({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decya": 0.1}}})
    assert "weight_decya" in str(err) and "weight_decay" in str(err)


def test_unknown_scheduler_param_is_named():
    err = error_of({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    assert err.key == "scheduler.params.warmup_num_step" and "warmup_num_steps" in str(err)


@pytest.mark.parametrize("name", ["LRScheduler", "_LRScheduler", "Optimizer", "Counter"])
def test_torch_helpers_are_not_schedulers(name):
    err = error_of({**BASE, "scheduler": {"type": name, "params": {}}})
    assert err.key == "scheduler.type" and "not a learning-rate scheduler" in str(err)


@pytest.mark.parametrize("name, guess", [("WarmupLr", "WarmupLR"), ("steplr", "StepLR"), ("CosineAnnealingLr", "CosineAnnealingLR")])
def test_unknown_scheduler_gets_did_you_mean(name, guess):
    err = error_of({**BASE, "scheduler": {"type": name, "params": {}}})
    assert err.key == "scheduler.type" and f"did you mean {guess!r}" in str(err)


@pytest.mark.parametrize("data, key", [
    ({"": 1}, "'' (empty key)"),
    ({"zero_optimization": {"": 1}}, "zero_optimization.'' (empty key)"),
    ({"optimizer": {"type": "AdamW", "params": {"": 1}}}, "optimizer.params.'' (empty key)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"": 1}}}, "scheduler.params.'' (empty key)"),
])
def test_empty_keys_are_named_readably(data, key):
    err = error_of({**BASE, **data})
    assert err.key == key and str(err).startswith(key) and "did you mean" not in str(err)


def test_union_member_tags_are_not_part_of_the_key():
    err = error_of({**BASE, "raydeep": {"partition_units": [1]}})
    assert err.key == "raydeep.partition_units, raydeep.partition_units.0"
    assert "list[" not in str(err)


@pytest.mark.parametrize("key", ["amp", "pipeline", "compression_training", "torch_autocast"])
def test_unimplemented_deepspeed_sections_are_refused(key):
    err = error_of({**BASE, key: {"enabled": True, "x": 1} if key != "pipeline" else {"stages": 2}})
    assert err.key == key and "not supported by raydeep" in str(err)


def test_harmless_unimplemented_keys_warn():
    cfg = load({"aio": {"block_size": 1048576}, "disable_allgather": False})
    assert any(w.startswith("aio:") for w in cfg.warnings)


@pytest.mark.parametrize("zero, key", [
    ({"stage": 3, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}, "zero_optimization.zeropp_loco_param"),
    ({"stage": 3, "mics_shard_size": 8}, "zero_optimization.mics_shard_size"),
    ({"stage": 3, "mics_shard_size": -1}, "zero_optimization.mics_shard_size"),  # 0.19.8 removed the key
])
def test_loco_and_mics_not_supported(zero, key):
    err = error_of({**BASE, "zero_optimization": zero})
    assert err.key == key and "not supported by raydeep" in str(err)


ZERO_PP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True,
           "zero_quantized_nontrainable_weights": True}


def test_zeropp_keys_load_at_stage_3_and_warn_below():
    cfg = load({**BASE, "zero_optimization": {"stage": 3, **ZERO_PP}})
    assert not [w for w in cfg.warnings if "zero_q" in w or "hpz" in w]
    assert cfg.zero_optimization.zero_hpz_partition_size == 8 and cfg.zero_optimization.zero_quantized_gradients
    cfg = load({**BASE, "zero_optimization": {"stage": 2, **ZERO_PP}})
    assert any("has no effect at ZeRO stage 2" in w and "ZeRO++" in w for w in cfg.warnings), cfg.warnings


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_is_refused_at_load_naming_the_key_and_what_to_use(section, stage):
    err = error_of({**BASE, "zero_optimization": {"stage": stage, section: {"device": "nvme", "pin_memory": True}}})
    assert err.key == f"zero_optimization.{section}.device" and err.value == "nvme"
    assert "NVMe" in str(err) and "not supported" in str(err) and '"cpu"' in err.fix


def test_cpu_offload_loads_and_warns_where_deepspeed_ignores_it():
    for stage in (1, 2, 3):
        cfg = load({**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                                  "sub_group_size": 1000}})
        assert cfg.zero_optimization.offload_optimizer.device == "cpu"
        assert not [w for w in cfg.warnings if "offload" in w or "sub_group" in w]
    cfg = load({**BASE, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert [w for w in cfg.warnings if "offload_optimizer has no effect at ZeRO stage 0" in w]
    cfg = load({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert [w for w in cfg.warnings if "offload_param has no effect at ZeRO stage 2" in w]
    cfg = load({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert not [w for w in cfg.warnings if "offload" in w]


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_offload_device_none_or_absent_is_fine(section):
    cfg = load({"zero_optimization": {"stage": 3, section: {"device": "none", "pin_memory": True}}})
    assert getattr(cfg.zero_optimization, section).device == "none"
    assert not [w for w in cfg.warnings if "offload" in w]


def test_offload_ratio_keeps_deepspeeds_stage_3_rule():
    err = error_of({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "ratio": 0.5}}})
    assert err.key == "zero_optimization.offload_optimizer.ratio" and "Partial offloading only supported" in str(err)


# --- deprecated spellings and aliases ----------------------------------------------------------

def test_stage3_aliases_and_deprecated_keys():
    cfg = load({"zero_optimization": {"stage": 3, "max_live_parameters": 7, "stage3_gather_fp16_weights_on_model_save": True,
                                      "cpu_offload": False}})
    zero = cfg.zero_optimization
    assert zero.max_live_parameters == 7 and zero.gather_16bit_weights_on_model_save
    assert zero.offload_optimizer is None  # cpu_offload: false means no offload section
    assert any("deprecated" in w for w in cfg.warnings)


def test_deprecated_cpu_offload_means_cpu_optimizer_offload():
    cfg = load({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_both_alias_spellings_is_an_error():
    err = error_of({**BASE, "zero_optimization": {"stage": 3, "max_live_parameters": 7, "stage3_max_live_parameters": 8}})
    assert "same setting" in str(err)


def test_deprecated_and_new_together_is_deepspeeds_error():
    err = error_of({**BASE, "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                                  "stage3_gather_16bit_weights_on_model_save": True}})
    assert "Cannot provide deprecated parameter" in str(err)


def test_bool_zero_and_legacy_bfloat16():
    cfg = load({"zero_optimization": True, "bfloat16": {"enabled": True}})
    assert cfg.zero_optimization.stage == 1 and cfg.bf16.enabled and cfg.precision == "bf16"


def test_deepspeed_defaults():
    cfg = load()
    zero = cfg.zero_optimization
    assert cfg.gradient_clipping == 1.0  # 0.19.8 default
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.overlap_comm) == (500_000_000, 500_000_000, False)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)
    assert (zero.max_live_parameters, zero.max_reuse_distance, zero.sub_group_size) == (10**9, 10**9, 10**9)
    assert load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    fp16 = cfg.fp16.scaler_args()
    assert fp16 == {"init_scale": 65536.0, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
                    "consecutive_hysteresis": False}


def test_element_counts_accept_float_notation_but_not_fractions():
    assert load({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}).zero_optimization.reduce_bucket_size == 500_000_000
    err = error_of({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}})
    assert err.key == "zero_optimization.reduce_bucket_size"


# --- cross-field rules -------------------------------------------------------------------------

ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.mark.parametrize("extra, key, text", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "cannot be simultaneously enabled"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "0, 1, 2 or 3"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True, "number_checkpoints": 4}},
     "activation_checkpointing.contiguous_memory_optimization", "only available with partitioned activations"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True, "partition_activations": True}},
     "activation_checkpointing.number_checkpoints", "Must specify the number of layers"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}}, "fp16": {"enabled": True},
      "zero_optimization": {"stage": 1}}, "zero_optimization.stage", "1bit-Adam is not compatible with ZeRO"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {}}, "zero_optimization": {"stage": 2}},
     "zero_optimization.stage", "0/1 Adam is not compatible with ZeRO"),
    ({"optimizer": {"type": "OneBitLamb", "params": {}}, "zero_optimization": {"stage": 1}},
     "zero_optimization.stage", "1-bit Lamb is not compatible with ZeRO"),
    ({"optimizer": ADAM, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "scheduler.params.total_num_steps", "required"),
    ({"optimizer": ADAM, "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}},
     "scheduler.params.cycle_min_lr", "required"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr", "positive"),
    ({"train_micro_batch_size_per_gpu": -2}, "train_micro_batch_size_per_gpu",
     "Micro batch size per gpu: -2 has to be greater than 0"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device", "NVMe"),
    ({"optimizer": {"type": "adamw2", "params": {}}}, "optimizer.type", "not a supported DeepSpeed Optimizer"),
    ({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}}, "optimizer.type", "not a supported DeepSpeed Optimizer"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}, "optimizer", "gradient_clipping"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}},
     "zero_allow_untested_optimizer", "untested ZeRO Optimizer"),
    ({"communication_data_type": "int8"}, "communication_data_type", "Supported data types: ['fp16', 'bf16', 'fp32']. Got: int8"),
    ({"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 3}}, "gradient_allreduce_op", "stage 3"),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 2}}, "prescale_gradients", "post-scaling"),
    ({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 3}}, "gradient_predivide_factor", "1.0"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, "data_types.grad_accum_dtype", "unsupported mix"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", "must be > 0 when dynamic"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0.5}}, "fp16.min_loss_scale", "integer"),
    ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "zero_optimization.compute_grad_norm", "Stage 1 or 2"),
    ({"zero_optimization": {"stage": 1, "legacy_stage1": True}}, "zero_optimization.legacy_stage1", "not supported"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", "greater than 0"),
])
def test_cross_field_rules(extra, key, text):
    err = error_of({**BASE, **extra})
    assert key in err.key and text in str(err), str(err)


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigErrors) as info:
        load({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "mics_shard_size": 8}})
    assert len(info.value.errors) == 2


@pytest.mark.parametrize("name, params", [("OneBitAdam", {"freeze_step": 100}), ("ZeroOneAdam", {"var_freeze_step": 100}),
                                          ("OneBitLamb", {"freeze_step": 100, "coeff_beta": 0.8})])
def test_compressed_communication_optimizers_load_at_stage_0_and_warn_outside_fp16(name, params, caplog):
    cfg = load({**BASE, "fp16": {"enabled": True}, "zero_optimization": {"stage": 0},
                "optimizer": {"type": name, "params": {"lr": 1e-3, **params}}})
    assert cfg.optimizer.type == name
    with caplog.at_level("WARNING", logger="raydeep"):
        load({**BASE, "optimizer": {"type": name, "params": {"lr": 1e-3, "comm_backend_name": "mpi",
                                                             "cuda_aware": True}}})
    text = caplog.text
    assert "only verified under FP16" in text and "comm_backend_name 'mpi'" in text and "cuda_aware" in text


@pytest.mark.parametrize("scaler, warned", [(1, True), (2, False), (16, False)])
def test_zero_one_adam_with_var_update_scaler_one_warns_that_it_diverges(scaler, warned, caplog):
    """DeepSpeed's own 0/1 Adam diverges there (tests/dist/test_compression_deepspeed_oracle.py)."""
    with caplog.at_level("WARNING", logger="raydeep"):
        load({**BASE, "fp16": {"enabled": True}, "optimizer": {"type": "ZeroOneAdam", "params": {
            "lr": 1e-3, "var_freeze_step": 100, "var_update_scaler": scaler}}})
    assert ("var_update_scaler = 1" in caplog.text and "diverges" in caplog.text) is warned, caplog.text


def test_onebit_lamb_loads_with_its_coefficient_params():
    cfg = load({**BASE, "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 100,
                                                                       "max_coeff": 0.3, "factor_threshold": 0.2}}})
    assert cfg.optimizer.type == "OneBitLamb"


def test_adam_means_adamw_unless_adam_w_mode_false():
    from raydeep.optim.optimizers import resolve_optimizer
    import torch

    assert resolve_optimizer("Adam", {"lr": 1e-3}).cls is torch.optim.AdamW
    assert resolve_optimizer("Adam", {"lr": 1e-3, "adam_w_mode": False}).cls is torch.optim.Adam
    assert load({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}).optimizer.type == "Adam"


def test_field_report_advice_for_long_accumulation_without_clipping():
    cfg = load_config({"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0})
    assert cfg.gradient_accumulation_steps == 128
    assert any("above 32 accumulation steps" in w for w in cfg.warnings)


def test_harmless_no_ops_warn():
    cfg = load({"zero_optimization": {"stage": 1, "round_robin_gradients": True, "contiguous_gradients": False},
                "activation_checkpointing": {"partition_activations": True}})
    text = "\n".join(cfg.warnings)
    assert "zero_optimization.round_robin_gradients = True has no effect" in text
    assert "zero_optimization.contiguous_gradients = False has no effect" in text
    assert "activation_checkpointing.partition_activations = True has no effect" in text


# --- elasticity (kept from DeepSpeed releases that had it) ------------------------------------

def test_elasticity_v01_plan_and_invalid_world_size():
    section = ElasticityConfig(enabled=True, max_train_batch_size=64, micro_batch_sizes=[2, 4], version=0.1)
    plan = elastic_plan(section, 2)
    assert plan.train_batch_size == 48 and plan.micro_batch * plan.grad_accum * 2 == 48
    assert valid_world_sizes(48, [2, 4], 1, 32) == [1, 2, 3, 4, 6, 8, 12, 24]
    with pytest.raises(ConfigError, match="is not valid with the current list of valid GPU counts"):
        elastic_plan(section, 5)


def test_elasticity_keeps_the_global_batch_across_world_sizes():
    data = {"elasticity": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                           "min_gpus": 1, "max_gpus": 64, "version": 0.1}}
    plans = {w: load_config(data, world_size=w) for w in (1, 2, 4, 8)}
    assert len({c.train_batch_size for c in plans.values()}) == 1
    for w, c in plans.items():
        assert c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * w == c.train_batch_size


def test_elasticity_refuses_batch_keys_unless_ignored():
    data = {"train_batch_size": 8, "elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2]}}
    assert "will not be used" in str(error_of(data))
    data["elasticity"]["ignore_non_elastic_batch_info"] = True
    assert load_config(data, world_size=2).train_batch_size % 2 == 0



def test_elasticity_v02_refuses_model_parallelism():
    data = {"elasticity": {"enabled": True, "max_train_batch_size": 1024, "micro_batch_sizes": [4, 8],
                           "num_gpus_per_node": 8, "model_parallel_size": 2, "version": 0.2}}
    err = error_of(data, world_size=1)
    assert err.key == "elasticity.model_parallel_size" and "not supported by raydeep" in str(err)


def test_elasticity_v02_fallback_below_one_node():
    # DeepSpeed's float data-parallel size, (1 / 49) * 49, truncates to 0; raydeep uses the world size.
    data = {"elasticity": {"enabled": True, "max_train_batch_size": 1024, "micro_batch_sizes": [4, 8],
                           "num_gpus_per_node": 49, "version": 0.2}}
    cfg = load_config(data, world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1024, 8, 128)


def test_elasticity_v02_fallback_with_no_batch_that_fits():
    data = {"elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [4], "version": 0.2}}
    err = error_of(data, world_size=4)
    assert err.key == "elasticity.max_train_batch_size" and "at least 16" in str(err)


def test_auto_as_a_real_value_is_not_a_placeholder():
    cfg = load_config({"train_batch_size": 2, "raydeep": {"partition_units": "auto"},
                       "data_types": {"keep_in_fp32_modules": "auto"}})
    assert cfg.raydeep.partition_units == "auto"
