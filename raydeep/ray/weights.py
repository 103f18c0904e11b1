"""The consolidated fp32 parameters of an engine, and a digest that makes two runs comparable.

Each rank's optimizer tier holds only its shard of every unit's fp32 master (ZeRO 1-3); an
all-gather per unit rebuilds the full flat buffer on every rank, and the unit's layout maps it
back to named parameters. The masters are what the optimizer updates, so this is the model's exact state in
any precision (in fp16/bf16 training the module's own weights are rounded copies of them).

``param_sha256`` hashes the parameters in name order (name, shape and little-endian fp32 bytes),
so equal digests mean bitwise-equal weights whatever the stage or world size that produced them.
"""
from __future__ import annotations

import hashlib

import torch

from raydeep import comm


def consolidated_fp32(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master value, full size, on CPU; collective: call on every rank."""
    named: dict[str, torch.Tensor] = {}
    state = engine.tier.state_dict(with_optimizer=False)
    for unit, piece in zip(engine.strategy.units, state.units):
        layout = unit.layout
        # The held range without padding, padded back (with zeros: no slot reads them) to the shard.
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=piece.master.device)
        base = unit.held_range()[2]
        shard[piece.start - base:piece.end - base].copy_(piece.master)
        if layout.world_size > 1:
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=shard.device)
            comm.all_gather(full, shard)
        else:
            full = shard
        for slot in layout.slots:
            named[slot.name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).cpu().clone()
    return dict(sorted(named.items()))


def param_sha256(named: dict[str, torch.Tensor]) -> str:
    """Digest of named fp32 parameters (see the module docstring).

    >>> a = {"w": torch.ones(2, 2)}
    >>> param_sha256(a) == param_sha256({"w": torch.ones(2, 2)}), param_sha256(a) == param_sha256({"w": torch.ones(4)})
    (True, False)
    """
    digest = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise |a - b| over parameters present in both (names must match)."""
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
    return max((float((a[n].float() - b[n].float()).abs().max()) for n in a if a[n].numel()), default=0.0)


def save_fp32(named: dict[str, torch.Tensor], uri: str) -> None:
    """Write the parameters as a safetensors file (local path or pyarrow.fs URI)."""
    import pyarrow.fs as pafs
    from safetensors.torch import save

    fs, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
    with fs.open_output_stream(path) as sink:
        sink.write(save({n: t.contiguous() for n, t in named.items()}))


def load_fp32(uri: str) -> dict[str, torch.Tensor]:
    import pyarrow.fs as pafs
    from safetensors.torch import load

    fs, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
    with fs.open_input_stream(path) as source:
        return load(source.read())

