"""An out-of-memory error inside the engine names the doctor's estimate and the knob to turn,
and stays the same exception (its type, message and traceback)."""
import pytest
import torch
from torch import nn

import raydeep
from raydeep.models import build_gpt


class Greedy(nn.Module):
    """The tiny GPT, whose forward (or backward) asks the allocator for far more than any machine has."""

    def __init__(self, where: str):
        super().__init__()
        self.gpt, self.where = build_gpt("gpt-tiny"), where
        self.config = self.gpt.config

    def forward(self, x, y):
        if self.where == "forward":
            torch.empty(2**50, dtype=torch.uint8)  # a petabyte: the CPU allocator refuses it
        loss = self.gpt(x, y)
        return _Hungry.apply(loss) if self.where == "backward" else loss


class _Hungry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.empty(2**50, dtype=torch.uint8)
        return grad


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_carries_the_estimate_and_the_knob(where):
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = raydeep.initialize(model=Greedy(where), config=cfg)
    x = torch.randint(0, 256, (4, 65))
    with pytest.raises(RuntimeError) as caught:
        engine.backward(engine(x[:, :-1], x[:, 1:]))
    err = caught.value
    assert "can't allocate memory" in str(err)  # the allocator's own message is kept
    note = "\n".join(getattr(err, "__notes__", []))
    assert f"out of memory in the {where}" in note
    assert "activations" in note and "optimizer_states" in note  # itemised
    assert "MB at the peak" in note and "raydeep doctor" in note  # the tiny GPT needs megabytes
    assert "What to turn" in note or "train_micro_batch_size_per_gpu" in note
    assert len(err.__notes__) == 1  # noted once, even where the error crosses two engine phases


def test_other_errors_pass_untouched():
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = raydeep.initialize(model=build_gpt("gpt-tiny"), config=cfg)
    with pytest.raises(ValueError) as caught:
        engine(torch.zeros(3, dtype=torch.long))  # not (batch, seq): the model's own error
    assert not getattr(caught.value, "__notes__", None)
