"""What DeepSpeed client scripts touch beyond ``engine.backward``/``engine.step``: the accelerator
object, the engine's public attributes, and the returned optimizer stepped by the client (Ray's
DeepSpeed example: ``model.backward(loss); optimizer.step(); lr_scheduler.step();
optimizer.zero_grad()``). Each was a failure of that example with only its imports changed.
The multi-rank behaviour against DeepSpeed itself: tests/dist/test_client_conformance.py.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import raydeep
from raydeep import accelerator as accel_module
from raydeep.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator


@pytest.fixture(autouse=True)
def _fresh_accelerator(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(accel_module, "_chosen", None)
    monkeypatch.setattr(accel_module, "_made", {})


# --- 1. `from raydeep.accelerator import get_accelerator` ------------------------------------------------

def test_the_cpu_accelerator_answers_what_client_scripts_ask(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and acc is get_accelerator()
    assert (acc.name(), acc.device_name(3), acc.current_device_name(), acc.communication_backend_name()) == \
        ("cpu", "cpu", "cpu", "gloo")
    acc.manual_seed(7)
    first = torch.rand(3)
    acc.manual_seed(7)
    assert torch.equal(first, torch.rand(3))
    held = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)  # 8 MiB the resident set must show
    assert acc.memory_allocated() >= held.numel() and acc.max_memory_allocated() >= acc.memory_allocated() - 1
    assert acc.total_memory() > acc.available_memory() > 0
    acc.synchronize(), acc.empty_cache()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    assert acc.FloatTensor(2).dtype == torch.float32 and acc.on_accelerator(torch.ones(1))
    with pytest.raises(NotImplementedError, match="compiles nothing"):
        acc.create_op_builder("CPUAdamBuilder")


def test_the_accelerator_follows_the_rank_placement_rule(monkeypatch):
    # No process group: CUDA where available (faked here), unless DS_ACCELERATOR=cpu.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(get_accelerator(), CudaAccelerator)
    assert get_accelerator().device_name(1) == "cuda:1" and get_accelerator().communication_backend_name() == "nccl"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CpuAccelerator)
    # A gloo group computes on the CPU even where CUDA is available (raydeep.comm.rank_device).
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(accel_module, "get_backend", lambda: "gloo")
    assert isinstance(get_accelerator(), CpuAccelerator)


def test_an_accelerator_raydeep_does_not_run_on_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='xpu': raydeep runs on cpu or cuda"):
        get_accelerator()


def test_set_accelerator_wins():
    mine = CpuAccelerator()
    accel_module.set_accelerator(mine)
    assert get_accelerator() is mine


# --- 2. the returned optimizer, stepped by the client --------------------------------------------------

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.05,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 4}}}
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _train(stage: int, client_steps: bool, precision: str = "fp32", **extra):
    config = {**CONFIG, "zero_optimization": {"stage": stage}, **extra}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    model = _model()
    engine, optimizer, _, scheduler = raydeep.initialize(model=model, model_parameters=model.parameters(),
                                                         config=config)
    dtype = next(model.parameters()).dtype
    losses, lrs = [], []
    for x, y in _batches():
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        if client_steps:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        else:
            engine.step()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    return engine, optimizer, losses, lrs


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (0, "bf16")])
def test_a_client_stepped_zero_optimizer_trains_like_engine_step_but_moves_no_counter(stage, precision, tmp_path):
    # DeepSpeed's ZeRO optimizer (and its bf16 one at stage 0) unscales, clips and updates in its
    # own step(): the same arithmetic as engine.step(), so the same bits. Only the engine's
    # counters differ: they move in engine.step() alone.
    engine, _, losses, lrs = _train(stage, client_steps=False, precision=precision)
    client, optimizer, client_losses, client_lrs = _train(stage, client_steps=True, precision=precision)
    assert client_losses == losses and client_lrs == lrs
    assert client_losses[-1] < client_losses[0]
    assert (engine.global_steps, engine.micro_steps) == (STEPS, STEPS)
    assert (client.global_steps, client.micro_steps, client.skipped_steps) == (0, 0, 0)
    assert optimizer.overflow is False and optimizer._global_grad_norm > 0.05  # clipped
    assert client.get_global_grad_norm() is None  # engine.step() never ran, as in DeepSpeed
    client.save_checkpoint(str(tmp_path))  # the tag is the engine's global step: still 0
    assert (tmp_path / "latest").read_text().strip() == "global_step0"


def test_fp32_stage_0_hands_back_an_optimizer_that_does_not_clip():
    # DeepSpeed returns the bare torch optimizer at fp32 stage 0: engine.step() clips before it
    # runs, optimizer.step() does not. The client loop then equals unclipped training.
    _, _, clipped, _ = _train(0, client_steps=False)
    _, _, client, _ = _train(0, client_steps=True)
    _, _, unclipped, _ = _train(0, client_steps=False, gradient_clipping=0.0)
    assert client == unclipped and client != clipped


def test_optimizer_step_off_the_boundary_says_what_to_call_instead():
    model = _model()
    engine, optimizer, _, _ = raydeep.initialize(model=model, config={
        **CONFIG, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}})
    x, y = _batches()[0]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps 2 .* Call model.step\(\)"):
        optimizer.step()
    with pytest.raises(ValueError, match="no closure"):
        optimizer.step(lambda: 0.0)
    with pytest.raises(NotImplementedError, match="engine.save_checkpoint"):
        optimizer.state_dict()


# --- 3. the engine's public attributes --------------------------------------------------------------------

def test_the_engine_answers_deepspeeds_attributes():
    model = _model()
    engine, *_ = raydeep.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 2},
                                                         "steps_per_print": 7})
    assert (engine.global_rank, engine.local_rank, engine.world_size, engine.dp_world_size, engine.mp_world_size) == \
        (0, 0, 1, 1, 1)
    assert (engine.zero_optimization(), engine.zero_optimization_partition_gradients(),
            engine.zero_optimization_partition_weights()) == (True, True, False)
    assert (engine.gradient_clipping(), engine.steps_per_print(), engine.zero_gather_16bit_weights_on_model_save()) \
        == (0.05, 7, False)
    with pytest.raises(AssertionError, match="incompatible with gradient partitioning logic of ZeRO stage 2"):
        with engine.no_sync():
            pass


def test_no_sync_and_a_manual_boundary_keep_then_reduce_the_gradients():
    # Stage 1 accumulates locally between boundaries; with the boundary set by hand, one
    # engine.step() after two backward passes applies both micro-batches' gradients.
    batches = _batches()
    model = _model()
    engine, *_ = raydeep.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 1}})
    with engine.no_sync():
        assert engine.inside_no_sync_ctxt
        with pytest.raises(AssertionError, match="reentry"):
            with engine.no_sync():
                pass
    engine.set_gradient_accumulation_boundary(False)
    assert not engine.is_gradient_accumulation_boundary()
    x, y = batches[0]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.set_gradient_accumulation_boundary(True)
    x, y = batches[1]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    # The reference: the same two micro-batches as one batch of 8 (mean of the two means).
    reference, *_ = raydeep.initialize(model=_model(), config={**CONFIG, "train_micro_batch_size_per_gpu": 8,
                                                               "zero_optimization": {"stage": 1}})
    x = torch.cat([batches[0][0], batches[1][0]])
    y = torch.cat([batches[0][1], batches[1][1]])
    reference.backward(2 * nn.functional.mse_loss(reference(x), y))  # the sum of the two micro-batch means
    reference.step()
    for mine, theirs in zip(model.parameters(), reference.module.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


# --- save_16bit_model ---------------------------------------------------------------------------------

def test_save_16bit_model_writes_the_model_dtype_weights(tmp_path):
    engine, *_ = _train(2, client_steps=False, precision="bf16")
    assert engine.save_16bit_model(str(tmp_path), "weights.bin")
    saved = torch.load(tmp_path / "weights.bin")
    assert list(saved) == list(engine.module.state_dict())
    for name, tensor in engine.module.state_dict().items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], tensor)


def test_at_stage_3_save_16bit_model_needs_deepspeeds_flag(tmp_path):
    engine, *_ = _train(3, client_steps=False)
    assert engine.save_16bit_model(str(tmp_path / "off")) is False and not (tmp_path / "off").exists()
    engine, *_ = _train(3, client_steps=False,
                        zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                           "stage3_param_persistence_threshold": 0})
    assert engine.save_16bit_model(str(tmp_path / "on"))
    saved = torch.load(tmp_path / "on" / "pytorch_model.bin")
    from raydeep.ray.weights import consolidated_fp32

    masters = consolidated_fp32(engine)
    assert sorted(saved) == sorted(masters)
    for name in masters:  # fp32 training: the module's weights are the masters
        assert torch.equal(saved[name], masters[name]), name


def test_what_the_engine_lacks_is_read_from_the_model():
    # DeepSpeed-Chat calls model.gradient_checkpointing_enable() on the engine; Hugging Face reads model.config.
    class Model(nn.Linear):
        marker = "the model's"

        def gradient_checkpointing_enable(self):
            return "enabled"

    engine, *_ = raydeep.initialize(model=Model(2, 2), config=CONFIG)
    assert engine.gradient_checkpointing_enable() == "enabled" and engine.marker == "the model's"
    assert isinstance(engine, raydeep.DeepSpeedEngine) and raydeep.get_accelerator() is get_accelerator()
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'no_such_name'"):
        engine.no_such_name


def test_a_client_torch_adamw_trains_like_the_configs_adamw():
    # torch's AdamW keeps Adam's `decoupled_weight_decay` in its defaults, which its own
    # constructor refuses: the tier rebuilds it over the masters with the keywords it takes.
    def run(client: bool) -> list[float]:
        model = _model()
        config = {k: v for k, v in CONFIG.items() if k != "scheduler"} | {"zero_optimization": {"stage": 2}}
        if client:
            config.pop("optimizer")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        engine, *_ = raydeep.initialize(model=model, optimizer=optimizer if client else None, config=config)
        losses = []
        for x, y in _batches():
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    assert run(client=True) == run(client=False)
