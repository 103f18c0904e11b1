"""raydeep.checkpointing (DeepSpeed's activation-checkpointing API) and the engine's module
selection, in one process."""
import logging

import pytest
import torch
from torch import nn

import raydeep
from raydeep import checkpointing
from raydeep.activation.wrap import apply_activation_checkpointing, select_modules, unwrap
from raydeep.models import build_gpt


class Counted(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)
        self.calls = 0

    def forward(self, x, scale=None):
        self.calls += 1
        y = self.drop(torch.tanh(self.lin(x)))
        return y * scale if scale is not None else y


def _grads(module, fn):
    torch.manual_seed(3)
    x = torch.randn(4, 8, requires_grad=True)
    fn(x).pow(2).sum().backward()
    out = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out


def test_checkpoint_recomputes_and_matches_plain_gradients():
    torch.manual_seed(0)
    m = Counted(p=0.5)  # dropout: the recomputation must replay the same random mask
    plain = _grads(m, m)
    m.calls = 0
    ckpt = _grads(m, lambda x: checkpointing.checkpoint(m, x))
    assert m.calls == 2
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_keyword_tensors_take_part_in_autograd():
    m = Counted()
    scale = torch.full((4, 8), 2.0, requires_grad=True)
    checkpointing.checkpoint(m, torch.randn(4, 8), scale=scale).sum().backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0


def test_nested_regions_recompute_once():
    inner, outer_lin = Counted(), nn.Linear(8, 8)

    def outer(x):
        return checkpointing.checkpoint(inner, outer_lin(x))

    checkpointing.checkpoint(outer, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert inner.calls == 2  # forward + the outer recomputation; a nested region would make it 3


def test_rng_tracker_state_is_replayed_in_recomputation():
    checkpointing.model_parallel_cuda_manual_seed(11)
    tracker = checkpointing.get_cuda_rng_tracker()
    m = Counted(p=0.5)

    def forked(x):
        with tracker.fork():
            return m(x)

    start = tracker.get_states()
    plain = _grads(m, forked)
    tracker.set_states(start)
    ckpt = _grads(m, lambda x: checkpointing.checkpoint(forked, x))
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 5)


def test_configure_reads_the_section_and_warns_for_unimplemented_options(caplog):
    config = {"train_batch_size": 1, "activation_checkpointing": {"partition_activations": True, "profile": True}}
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        checkpointing.configure(None, deepspeed_config=config, profile=False, num_checkpoints=4)
    assert checkpointing.is_configured()
    assert "partition_activations" in caplog.text and "profile" not in caplog.text

    class MPU:
        def get_model_parallel_world_size(self):
            return 2
    with pytest.raises(NotImplementedError):
        checkpointing.configure(MPU())


def test_deepspeed_import_alias_exposes_the_api():
    import raydeep as deepspeed

    assert deepspeed.checkpointing.checkpoint is checkpointing.checkpoint
    assert deepspeed.checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint


def test_module_selection():
    model = build_gpt("gpt-tiny", n_layer=2, n_embd=32, n_head=2)
    names = lambda spec: [type(m).__name__ for m in select_modules(model, spec)]  # noqa: E731
    assert names("attention") == ["CausalSelfAttention"] * 2
    assert names("block") == ["Block"] * 2
    assert names(["MLP", "Block"]) == ["Block"] * 2  # outermost only
    assert names("none") == []
    generic = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), 2, enable_nested_tensor=False)
    assert [type(m).__name__ for m in select_modules(generic, "attention")] == ["MultiheadAttention"] * 2
    assert [type(m).__name__ for m in select_modules(generic, "block")] == ["TransformerEncoderLayer"] * 2


def test_engine_wraps_only_when_the_section_is_present(caplog):
    from raydeep.config.sections import ActivationCheckpointingConfig

    model = build_gpt("gpt-tiny", n_layer=2, n_embd=32, n_head=2)
    assert apply_activation_checkpointing(model, None, "block") == []
    assert apply_activation_checkpointing(model, ActivationCheckpointingConfig(), "none") == []
    section = ActivationCheckpointingConfig(synchronize_checkpoint_boundary=True, partition_activations=True)
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        wrapped = apply_activation_checkpointing(model, section, "attention")
    assert wrapped == [b.attn for b in model.blocks] and all("forward" in m.__dict__ for m in wrapped)
    # the options raydeep does not implement are reported once, when the config loads: not again here
    assert "synchronize_checkpoint_boundary" not in caplog.text and "partition_activations" not in caplog.text
    for m in wrapped:
        unwrap(m)
    assert not any("forward" in b.attn.__dict__ for b in model.blocks)


def test_model_calling_checkpoint_itself_trains_in_the_engine():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Counted() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = raydeep.checkpointing.checkpoint(block, x)  # DeepSpeed-style model code
            return x.pow(2).mean()

    net = Net()
    engine, *_ = raydeep.initialize(model=net, config={
        "train_batch_size": 4, "activation_checkpointing": {}, "raydeep": {"checkpoint_modules": "block"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    loss = engine(torch.randn(4, 8))
    engine.backward(loss)
    engine.step()
    assert [b.calls for b in net.blocks] == [2, 2]  # the engine's wrapping adds no second region
