"""Unit tests for the built-in GPT model family."""

from __future__ import annotations

import math

import pytest
import torch

from raydeep.data import builtin_dataset
from raydeep.models import (
    GPT,
    GPT_SIZES,
    Block,
    CausalSelfAttention,
    GPTConfig,
    build_gpt,
    estimate_num_params,
    gpt_config,
)


@pytest.fixture(autouse=True)
def _few_threads():
    # The CI box has 2 cores shared with other jobs; more threads only thrash.
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def _tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return build_gpt("gpt-tiny", **overrides)


# Expected totals (tied lm_head unless noted), from the closed-form count.
EXPECTED_PARAMS = {
    "gpt-tiny": 842_496,
    "gpt-small-cpu": 5_289_472,  # untied lm_head
    "gpt2-small": 124_475_904,
    "gpt2-medium": 354_871_296,
    "gpt-760m": 758_799_360,
    "gpt-1.3b": 1_315_819_520,
}


def test_named_sizes_have_expected_shapes():
    assert set(GPT_SIZES) == set(EXPECTED_PARAMS)
    tiny = gpt_config("gpt-tiny")
    assert (tiny.vocab_size, tiny.block_size, tiny.n_layer, tiny.n_embd, tiny.n_head) == (256, 128, 4, 128, 4)
    big = gpt_config("gpt-1.3b")
    assert (big.vocab_size, big.block_size, big.n_layer, big.n_embd, big.n_head) == (50304, 2048, 24, 2048, 16)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_estimated_param_counts(name):
    assert estimate_num_params(gpt_config(name)) == EXPECTED_PARAMS[name]


def test_param_counts_match_nominal_sizes():
    def approx(name, nominal, rel):
        return abs(EXPECTED_PARAMS[name] - nominal) / nominal < rel

    assert approx("gpt-small-cpu", 5.3e6, 0.01)
    assert approx("gpt2-small", 124e6, 0.01)
    assert approx("gpt2-medium", 350e6, 0.03)
    assert approx("gpt-760m", 760e6, 0.01)
    assert approx("gpt-1.3b", 1.3e9, 0.02)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small-cpu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_estimate_matches_built_model(name, bias, tie):
    cfg = gpt_config(name, bias=bias, tie_weights=tie)
    model = GPT(cfg)
    for non_embedding in (False, True):
        assert model.num_params(non_embedding) == estimate_num_params(cfg, non_embedding)


def test_estimate_matches_gpt2_small_on_meta():
    # The meta device allocates nothing, so the full 124M model is free to build.
    with torch.device("meta"):
        model = build_gpt("gpt2-small")
    assert model.num_params() == estimate_num_params(model.config) == EXPECTED_PARAMS["gpt2-small"]


def test_config_validation_and_overrides():
    assert gpt_config("gpt-tiny", n_layer=2, dropout=0.1).n_layer == 2
    assert GPT_SIZES["gpt-tiny"].n_layer == 4  # overrides do not leak into the table
    with pytest.raises(KeyError, match="gpt-tiny"):
        gpt_config("no-such-size")
    with pytest.raises(ValueError):
        gpt_config("gpt-tiny", n_head=3)
    with pytest.raises(TypeError):
        gpt_config("gpt-tiny", not_a_field=1)


def test_forward_shapes_and_length_check():
    model = _tiny()
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)
    loss = model(idx, idx)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    with pytest.raises(ValueError):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_structure_hooks_for_engine():
    model = _tiny()
    assert GPT.block_class is Block
    blocks = model.transformer_blocks()
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == 4
    assert all(isinstance(b, GPT.block_class) for b in blocks)
    attn = model.attention_modules()
    assert len(attn) == 4 and all(isinstance(a, CausalSelfAttention) for a in attn)
    assert model.lm_head.weight is model.wte.weight
    untied = _tiny(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight


def test_initial_loss_is_log_vocab():
    model = _tiny()
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (8, 128), generator=gen)
    targets = torch.randint(0, 256, (8, 128), generator=gen)
    with torch.no_grad():
        loss = model(idx, targets).item()
    assert abs(loss - math.log(256)) < 0.1


def test_init_statistics():
    model = _tiny()
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    proj_std = model.blocks[0].mlp.c_proj.weight.std().item()
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)
    assert torch.count_nonzero(model.blocks[0].attn.c_attn.bias) == 0


def test_deterministic_under_seed():
    a, b = _tiny(), _tiny()
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    torch.manual_seed(1)
    c = build_gpt("gpt-tiny")
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_backward_reaches_every_parameter():
    model = _tiny(bias=True, tie_weights=False)
    idx = torch.randint(0, 256, (2, 32))
    model(idx, torch.roll(idx, -1, dims=1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_flops_per_token():
    model = _tiny()
    cfg = model.config
    n = model.num_params(non_embedding=True)
    assert n == model.num_params() - cfg.block_size * cfg.n_embd
    assert model.flops_per_token() == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert model.flops_per_token(seq_len=64) < model.flops_per_token()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_backward_on_cpu(dtype):
    model = _tiny(n_layer=2, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    idx = torch.randint(0, 256, (2, 64))
    logits = model(idx)
    assert logits.dtype == dtype
    loss = model(idx, torch.roll(idx, -1, dims=1))
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())


def test_generate_extends_sequence():
    model = _tiny(n_layer=1).eval()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=5, top_k=10)
    assert out.shape == (2, 8) and out.max() < 256


def test_tiny_model_learns_builtin_corpus():
    dataset = builtin_dataset(block_size=128, max_bytes=400_000)
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        ids = torch.randint(len(dataset), (8,), generator=gen).tolist()
        x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in ids)))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses


def test_build_from_config_object():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=False)
    model = build_gpt(cfg, dropout=0.1)
    assert model.config.dropout == 0.1 and cfg.dropout == 0.0
    assert model.blocks[0].ln_1.bias is None
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)
