"""Built-in model families."""

from raydeep.models.gpt import (
    GPT,
    GPT_SIZES,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    build_gpt,
    estimate_num_params,
    gpt_config,
)

__all__ = [
    "GPT",
    "GPT_SIZES",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "build_gpt",
    "estimate_num_params",
    "gpt_config",
]
