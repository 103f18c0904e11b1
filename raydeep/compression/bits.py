"""Sign bits packed eight to a byte, on any device, and the padding that makes them split evenly.

1-bit compression sends one bit per element: 1 for ``x >= 0`` (DeepSpeed maps a zero to +1, so
every element decodes to +1 or -1) and 0 otherwise, most significant bit first, as numpy's and
cupy's ``packbits`` order them. Packing is plain tensor arithmetic, so it runs wherever the tensor
lives: no cupy, no kernels to build.

>>> packed = pack_signs(torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, -1.0, 5.0]))
>>> packed.tolist(), unpack_signs(packed, 8).tolist()
([185], [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
"""
from __future__ import annotations

import math

import torch

_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return _WEIGHTS[device]


def signs(x: torch.Tensor) -> torch.Tensor:
    """+1 where ``x >= 0`` (zero included, as DeepSpeed's ``sign().add_(1).bool()``), else -1,
    in ``x``'s dtype."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``ceil(n/8)`` bytes: bit ``7 - i % 8`` of byte ``i // 8`` is 1 where ``x[i] >= 0``.
    A length that is not a multiple of 8 is padded with 0 bits."""
    flat = x.reshape(-1)
    bits = (flat >= 0).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _bit_weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``n`` signs in ``packed`` as +1/-1 of ``dtype``."""
    # ``narrow``, not ``[:n]``: Python slicing needs a device guard that a CPU-only torch build lacks
    # for (fake) CUDA tensors, so the FakeTensorMode tests could not follow it.
    bits = packed.reshape(-1, 1).bitwise_and(_bit_weights(packed.device)).ne(0).reshape(-1).narrow(0, 0, n)
    return bits.to(dtype).mul_(2).sub_(1)


def padded_size(numel: int, world_size: int) -> int:
    """DeepSpeed's padding for a compressed tensor: up to a multiple of
    ``world_size * lcm(world_size, 8)``, so every rank's server chunk is a whole number of bytes
    and itself splits evenly across the ranks.

    >>> padded_size(100, 1), padded_size(100, 2), padded_size(100, 3), padded_size(100, 4)
    (104, 112, 144, 128)
    """
    unit = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return -(-numel // unit) * unit


def packed_nbytes(numel: int) -> int:
    """Bytes of ``numel`` packed signs."""
    return -(-numel // 8)
