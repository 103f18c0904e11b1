"""A nanoGPT-style decoder-only transformer family used for demos, tests and benchmarks.

The model is deliberately plain: token + learned position embeddings, a stack of
pre-LayerNorm blocks (causal self-attention + GELU MLP), a final LayerNorm and an
lm_head that shares its weight with the token embedding by default. The pieces
the ZeRO runtime cares about are exposed explicitly:

* ``GPT.block_class`` / ``GPT.transformer_blocks()`` -- each transformer block is
  one ZeRO-3 partition unit (gathered before it runs, released after).
* ``GPT.attention_modules()`` -- the submodules activation checkpointing wraps by
  default (attention dominates activation memory at long context).

Example:
    >>> import torch
    >>> from raydeep.models.gpt import build_gpt
    >>> _ = torch.manual_seed(0)
    >>> model = build_gpt("gpt-tiny")
    >>> idx = torch.randint(0, 256, (2, 16))
    >>> model(idx).shape
    torch.Size([2, 16, 256])
    >>> model(idx, idx).item() > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT_SIZES",
    "gpt_config",
    "estimate_num_params",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "GPT",
    "build_gpt",
]

# Standard deviation of the normal init for every weight matrix and embedding
# (GPT-2 / nanoGPT convention).
_INIT_STD = 0.02


@dataclass
class GPTConfig:
    """Shape and regularisation hyper-parameters of a :class:`GPT`.

    Example:
        >>> cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
        >>> cfg.head_dim
        16
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head


def _size(vocab: int, block: int, layers: int, d: int, heads: int, **kw: object) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_embd=d, n_head=heads, **kw)


# 50304 = GPT-2's 50257 rounded up to a multiple of 64, which keeps the
# embedding/lm_head matmuls on fast tensor-core shapes.
GPT_SIZES: Mapping[str, GPTConfig] = MappingProxyType(
    {
        # Byte-level model small enough to train for a few hundred steps on 2 CPU cores.
        "gpt-tiny": _size(256, 128, 4, 128, 4),
        # Benchmark model (~5.3M params). The lm_head is untied so the count
        # includes a separate 4096x256 output matrix.
        "gpt-small-cpu": _size(4096, 128, 4, 256, 4, tie_weights=False),
        "gpt2-small": _size(50304, 1024, 12, 768, 12),
        "gpt2-medium": _size(50304, 1024, 24, 1024, 16),
        "gpt-760m": _size(50304, 1024, 24, 1536, 16),
        "gpt-1.3b": _size(50304, 2048, 24, 2048, 16),
    }
)


def gpt_config(name: str, **overrides: object) -> GPTConfig:
    """Return a fresh copy of the named size, with optional field overrides.

    Example:
        >>> gpt_config("gpt-tiny", n_layer=2).n_layer
        2
    """
    try:
        base = GPT_SIZES[name]
    except KeyError:
        raise KeyError(f"unknown GPT size {name!r}; known sizes: {sorted(GPT_SIZES)}") from None
    # replace() re-runs __post_init__, so overrides are validated too.
    return dataclasses.replace(base, **overrides)


def estimate_num_params(config: GPTConfig, non_embedding: bool = False) -> int:
    """Analytic parameter count of ``GPT(config)`` without building it.

    Matches :meth:`GPT.num_params` exactly (same ``non_embedding`` meaning).

    Example:
        >>> estimate_num_params(gpt_config("gpt2-small"))
        124475904
    """
    d, v, t, n = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    b = 1 if config.bias else 0
    ln = d + b * d
    attn = d * 3 * d + b * 3 * d + d * d + b * d
    mlp = d * 4 * d + b * 4 * d + 4 * d * d + b * d
    per_block = 2 * ln + attn + mlp
    lm_head = 0 if config.tie_weights else v * d
    total = v * d + t * d + n * per_block + ln + lm_head
    if non_embedding:
        total -= t * d
        if not config.tie_weights:
            total -= v * d
    return total


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention backed by ``F.scaled_dot_product_attention``.

    Example:
        >>> attn = CausalSelfAttention(gpt_config("gpt-tiny"))
        >>> attn(torch.zeros(1, 8, 128)).shape
        torch.Size([1, 8, 128])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # One fused projection for q, k and v: a single larger matmul is faster
        # than three small ones and is a single tensor for ZeRO to partition.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, width = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, nh, T, hd), the layout SDPA expects.
        q, k, v = (t.view(bsz, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(bsz, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear(d, 4d) -> GELU -> Linear(4d, d).

    Example:
        >>> MLP(gpt_config("gpt-tiny"))(torch.zeros(1, 4, 128)).shape
        torch.Size([1, 4, 128])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Example:
        >>> Block(gpt_config("gpt-tiny"))(torch.zeros(2, 4, 128)).shape
        torch.Size([2, 4, 128])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model.

    ``forward(idx)`` returns logits of shape ``(B, T, vocab_size)``;
    ``forward(idx, targets)`` returns the mean cross-entropy loss as a scalar
    (targets equal to -100 are ignored, as in ``F.cross_entropy``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = GPT(gpt_config("gpt-tiny", n_layer=1))
        >>> len(model.transformer_blocks()), len(model.attention_modules())
        (1, 1)
        >>> model.lm_head.weight is model.wte.weight
        True
    """

    # The ZeRO-3 engine partitions and gathers parameters one instance of this
    # class at a time.
    block_class: type[nn.Module] = Block

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re-)initialise all weights; deterministic given the global torch seed."""
        # Walk modules in registration order so the RNG stream is consumed in
        # the same order on every construction.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # GPT-2: scale residual-path projections by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth (two adds per block).
        proj_std = _INIT_STD / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=proj_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=proj_std)

    def transformer_blocks(self) -> nn.ModuleList:
        """The ordered transformer blocks (ZeRO-3 partition units)."""
        return self.blocks

    def attention_modules(self) -> list[nn.Module]:
        """Attention submodules, in depth order (default activation-checkpoint targets)."""
        return [block.attn for block in self.blocks]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` for ``idx`` of shape ``(B, T)``, or the scalar loss if ``targets``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.size(1)
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # Softmax over a large vocabulary in bf16/fp16 loses precision (and can
        # overflow in fp16), so the loss is always computed in fp32.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of unique parameters (tied weights counted once).

        With ``non_embedding=True`` the pure lookup tables are excluded: the
        position embedding always, and the token embedding only when it is not
        tied (a tied token embedding also serves as the lm_head matmul).
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wpe.weight.numel()
            if self.lm_head.weight is not self.wte.weight:
                total -= self.wte.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: ``6N + 12 * L * d * T`` (forward + backward).

        ``N`` is the non-embedding parameter count (matmul work), the second
        term is attention's score/value matmuls at sequence length ``T``
        (defaults to ``block_size``). Used to compute MFU.
        """
        cfg = self.config
        seq = cfg.block_size if seq_len is None else seq_len
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Autoregressively sample ``max_new_tokens`` tokens after ``idx`` (B, T).

        Example:
            >>> _ = torch.manual_seed(0)
            >>> build_gpt("gpt-tiny", n_layer=1).generate(torch.zeros(1, 1, dtype=torch.long), 4).shape
            torch.Size([1, 5])
        """
        for _ in range(max_new_tokens):
            # Only the last block_size tokens fit in the position embedding.
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :].float() / max(temperature, 1e-8)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_tok = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_tok), dim=1)
        return idx


def build_gpt(
    name_or_config: str | GPTConfig, *, dtype: torch.dtype | None = None, **overrides: object
) -> GPT:
    """Build a :class:`GPT` from a size name (see ``GPT_SIZES``) or a config.

    ``overrides`` replace config fields; ``dtype`` casts the parameters after
    the fp32 init (so a seed gives the same weights, up to rounding, in any dtype).
    Construct under ``with torch.device("meta"):`` to get a model without memory.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = build_gpt("gpt-tiny", n_layer=2, dtype=torch.bfloat16)
        >>> model.wte.weight.dtype, len(model.blocks)
        (torch.bfloat16, 2)
    """
    if isinstance(name_or_config, GPTConfig):
        config = dataclasses.replace(name_or_config, **overrides)
    else:
        config = gpt_config(name_or_config, **overrides)
    model = GPT(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model
