"""raydeep.zero.Init on 2 and 4 gloo ranks.

- Construction never holds more full parameter bytes than the largest single module owns, while
  the model is many times larger (sampled after every torch call and parameter registration, from
  the storages of all parameters registered so far).
- A model built under Init -- or partitioned afterwards with Init(module=...) -- equals rank 0's
  model built normally, even when every rank seeds differently, and trains at stage 3 (and, gathered,
  at stage 2) to the same parameters as the normally built model.
- GatheredParameters works on Init-partitioned parameters before the engine exists.
"""
import pytest

from tests.dist.harness import run_ranks

STEPS, MICRO = 5, 2


def _gpt():
    from raydeep.models import build_gpt
    from tests.dist.workloads import SEQ

    return build_gpt("gpt-tiny", block_size=SEQ, n_layer=4, n_embd=64, n_head=4)


def _construction_peak(rank: int) -> dict:
    """Build under Init while sampling the bytes held by every parameter registered so far."""
    import torch
    from torch.nn.modules.module import register_module_parameter_registration_hook
    from torch.overrides import TorchFunctionMode

    import raydeep

    params, peak = [], [0]

    def resident() -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        return sum(storages.values())

    def sample():
        peak[0] = max(peak[0], resident())

    class Sampler(TorchFunctionMode):  # entered first, so it also sees the calls Init's own mode makes
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sample()
            return out

    def on_register(module, name, param):  # returns None: a returned value would replace the parameter
        params.append(param)
        sample()

    handle = register_module_parameter_registration_hook(on_register)
    torch.manual_seed(100 + rank)  # rank 0's model must win: Init broadcasts from rank 0
    try:
        with Sampler(), raydeep.zero.Init():
            model = _gpt()
    finally:
        handle.remove()
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    slices = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    return {"model": model, "peak": peak[0], "largest": largest, "total": total, "slices": slices,
            "placeholders": sum(p.element_size() for p in model.parameters())}


def _train(model, stage: int) -> dict:
    import raydeep
    from raydeep import comm
    from raydeep.zero import GatheredParameters
    from tests.dist.workloads import config, run_steps

    engine, *_ = raydeep.initialize(model=model, config=config(stage, 1, MICRO, 1.0))
    losses = run_steps(engine, STEPS, MICRO * comm.world_size())
    with GatheredParameters(list(model.parameters())):
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "memory": engine.memory_breakdown()}


def _normal_model():
    import torch

    torch.manual_seed(100)
    return _gpt()


def _custom_init_checks() -> dict:
    """Init-time code that touches already-partitioned parameters through ``.data`` and nn.init,
    in a class defined inside the context; GatheredParameters with a modifier rank."""
    from torch import nn

    import raydeep
    from raydeep import comm
    from raydeep.zero import GatheredParameters

    linear_init = nn.Linear.__init__
    with raydeep.zero.Init(), raydeep.zero.Init():  # nested: the inner context is a no-op
        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 6)
                self.lin.weight.data.fill_(0.5)  # an alias of a partitioned parameter
                nn.init.constant_(self.lin.bias, float(comm.rank() + 1))  # ranks differ: rank 0 must win
        module = Scaled()
    weight, bias = module.lin.weight, module.lin.bias
    out = {"shape": tuple(weight.shape), "nan_outside": bool(weight.isnan().all()),
           "restored": nn.Linear.__init__ is linear_init and "__init_subclass__" not in nn.Module.__dict__
           and not hasattr(nn.Linear(2, 2).weight, "ds_tensor")}
    with GatheredParameters([weight, bias]):
        out["weight"], out["bias"] = weight.detach().clone(), bias.detach().clone()
    with GatheredParameters([bias], modifier_rank=0):
        if comm.rank() == 0:
            bias.data.mul_(3)
    with GatheredParameters([bias]):
        out["bias_after"] = bias.detach().clone()
    return out


def zero_init_checks(everything: bool) -> dict:
    import torch

    import raydeep
    from raydeep import comm
    from raydeep.zero import GatheredParameters

    rank = comm.rank()
    out = {"world": comm.world_size()}
    built = _construction_peak(rank)
    model = built.pop("model")
    out["construction"] = built
    reference = _normal_model()
    with GatheredParameters(list(model.parameters())):
        out["init_vs_rank0"] = max((a - b).abs().max().item()
                                   for a, b in zip(model.parameters(), reference.parameters()))
    out["normal3"] = _train(reference, 3)
    out["init3"] = _train(model, 3)
    torch.manual_seed(100 + 7 * rank)  # Init(module=...) must take rank 0's weights
    later = _gpt()
    raydeep.zero.Init(module=later)
    out["module3"] = _train(later, 3)
    if not everything:  # the stage-2 path and the init-time interception do not depend on the world size
        return out
    out["normal2"] = _train(_normal_model(), 2)
    torch.manual_seed(100 + rank)
    with raydeep.zero.Init():
        init2 = _gpt()
    out["init2"] = _train(init2, 2)
    out["custom"] = _custom_init_checks()
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_init(world_size):
    import torch

    results = run_ranks(zero_init_checks, world_size, world_size == 2)
    for rank, res in enumerate(results):
        c = res["construction"]
        # (a) never more than one module's own parameters in full (+ one element per placeholder)
        assert c["peak"] <= c["largest"] + c["placeholders"], f"rank {rank}: {c}"
        assert c["total"] >= 8 * c["largest"], c
        assert c["slices"] <= c["total"] / world_size + 4 * 64, c  # only this rank's slices remain
        assert res["init_vs_rank0"] == 0.0
        # (b), (c) training at stage 3 and, gathered, at stage 2
        for got, want in (("init3", "normal3"), ("module3", "normal3"), ("init2", "normal2")):
            if got not in res:
                continue
            diff = _max_diff(res[got]["params"], res[want]["params"])
            assert diff <= 1e-6, f"rank {rank}: {got} vs {want}: max |dtheta| {diff:.3g}"
            assert res[got]["losses"] == pytest.approx(res[want]["losses"], abs=1e-6)
        assert res["init3"]["memory"]["params"] == res["normal3"]["memory"]["params"]
        custom = res.get("custom")
        if custom is None:
            continue
        assert custom["shape"] == (6, 8) and custom["nan_outside"] and custom["restored"]
        assert torch.equal(custom["weight"], torch.full((6, 8), 0.5))
        assert torch.equal(custom["bias"], torch.ones(6)) and torch.equal(custom["bias_after"], torch.full((6,), 3.0))
    c = results[0]["construction"]
    print(f"\nworld {world_size}: construction peak {c['peak']} B of full parameters (largest module {c['largest']} B, "
          f"model {c['total']} B, this rank's slices {c['slices']} B)")


def test_init_arguments_in_one_process(caplog):
    import logging

    import torch
    from torch import nn

    import raydeep

    with raydeep.zero.Init(enabled=False):
        assert not hasattr(nn.Linear(2, 2).weight, "ds_tensor")
    with caplog.at_level(logging.WARNING, logger="raydeep"), \
            raydeep.zero.Init(config_dict_or_path={"bf16": {"enabled": True}}, remote_device="cpu", frobnicate=1):
        layer = nn.Linear(4, 3)
        with pytest.raises(RuntimeError, match="view of a zero.Init-partitioned parameter"):
            layer.weight.T.sum()  # a view made from metadata alone cannot be gathered
    assert "frobnicate" in caplog.text
    assert layer.weight.dtype == layer.weight.ds_tensor.dtype == torch.bfloat16 and layer.weight.shape == (3, 4)
    layer.float()  # converts the slices; converting the placeholders would materialise NaN-filled parameters
    assert layer.weight.dtype == layer.weight.ds_tensor.dtype == torch.float32 and hasattr(layer.weight, "ds_tensor")
    assert layer.weight.untyped_storage().nbytes() == 4
    with pytest.raises(NotImplementedError):
        raydeep.zero.Init(mpu=object())
    engine, *_ = raydeep.initialize(model=layer, config={"train_batch_size": 2, "bf16": {"enabled": True},
                                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert not hasattr(layer.weight, "ds_tensor") and not layer.weight.isnan().any()  # gathered at stage 0
