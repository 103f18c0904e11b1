"""Unit tests for the embedded byte corpus and the synthetic token datasets."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from raydeep.data import (
    DEFAULT_CORPUS_BYTES,
    ByteTokenDataset,
    SyntheticTokenDataset,
    builtin_corpus_bytes,
    builtin_corpus_files,
    builtin_dataset,
    synthetic_dataset,
)


def test_corpus_files_are_sorted_stdlib_sources():
    files = builtin_corpus_files()
    root = os.path.dirname(os.__file__)
    assert "os.py" in files and all(f.endswith(".py") for f in files)
    assert not any(part in {"site-packages", "test", "__pycache__"} for f in files for part in f.split(os.sep))
    assert not any(os.path.basename(f).startswith("_sysconfigdata") for f in files)
    top = [f for f in files if os.sep not in f]
    assert top == sorted(top) and files[: len(top)] == top
    assert all(os.path.isfile(os.path.join(root, f)) for f in files[:20])


def test_corpus_bytes_deterministic_and_capped():
    data = builtin_corpus_bytes()
    assert isinstance(data, bytes) and len(data) == DEFAULT_CORPUS_BYTES
    builtin_corpus_bytes.cache_clear()  # force a second read from disk
    assert builtin_corpus_bytes() == data
    small = builtin_corpus_bytes(1000)
    assert len(small) == 1000 and data.startswith(small)
    root = os.path.dirname(os.__file__)
    with open(os.path.join(root, builtin_corpus_files()[0]), "rb") as fh:
        assert data.startswith(fh.read())
    with pytest.raises(ValueError):
        builtin_corpus_bytes(0)


def test_corpus_is_text():
    data = builtin_corpus_bytes(200_000)
    assert b"def " in data and b"import " in data
    # Mostly printable ASCII: this is source code, not binary noise.
    arr = np.frombuffer(data, dtype=np.uint8)
    assert ((arr >= 32) & (arr < 127) | (arr == 10)).mean() > 0.9


def test_byte_dataset_windows_and_shift():
    data = bytes(range(256)) * 4  # 1024 bytes
    ds = ByteTokenDataset(data, block_size=15)
    assert len(ds) == 1024 // 16
    for i in (0, 5, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (15,) and x.dtype == y.dtype == torch.int64
        window = torch.tensor(list(data[i * 16 : (i + 1) * 16]))
        assert torch.equal(x, window[:-1]) and torch.equal(y, window[1:])
        assert torch.equal(x[1:], y[:-1])
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_byte_dataset_accepts_arrays_and_tensors():
    raw = b"hello world, hello bytes!"
    from_np = ByteTokenDataset(np.frombuffer(raw, dtype=np.uint8), block_size=4)
    from_tensor = ByteTokenDataset(torch.tensor(list(raw), dtype=torch.uint8), block_size=4)
    from_bytes = ByteTokenDataset(raw, block_size=4)
    assert len(from_np) == len(from_tensor) == len(from_bytes) == 5
    assert torch.equal(from_np[2][1], from_bytes[2][1]) and torch.equal(from_tensor[2][0], from_bytes[2][0])
    with pytest.raises(TypeError):
        ByteTokenDataset(torch.zeros(10, dtype=torch.int64), block_size=4)
    with pytest.raises(ValueError):
        ByteTokenDataset(raw, block_size=0)


def test_builtin_dataset_batches_through_dataloader():
    ds = builtin_dataset(block_size=128, max_bytes=129 * 50 + 7)
    assert len(ds) == 50
    x, y = next(iter(DataLoader(ds, batch_size=8, shuffle=False)))
    assert x.shape == y.shape == (8, 128) and x.max() < 256
    restored = pickle.loads(pickle.dumps(ds))  # datasets travel to remote workers
    assert torch.equal(restored[7][0], ds[7][0])


def test_synthetic_dataset_contract_and_determinism():
    ds = synthetic_dataset(20, block_size=32, vocab_size=4096, seed=3)
    assert isinstance(ds, SyntheticTokenDataset) and len(ds) == 20
    x, y = ds[4]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]) and 0 <= x.min() and x.max() < 4096
    again = synthetic_dataset(20, block_size=32, vocab_size=4096, seed=3)
    assert all(torch.equal(ds[i][0], again[i][0]) and torch.equal(ds[i][1], again[i][1]) for i in range(20))
    # Order of access must not matter: sample i depends only on (seed, i).
    assert torch.equal(again[19][0], synthetic_dataset(20, 32, 4096, seed=3)[19][0])
    other = synthetic_dataset(20, block_size=32, vocab_size=4096, seed=4)
    assert not torch.equal(ds[0][0], other[0][0])
    assert not torch.equal(ds[0][0], ds[1][0])
    with pytest.raises(IndexError):
        ds[20]


def test_synthetic_periodic_pattern():
    ds = synthetic_dataset(3, block_size=20, vocab_size=50, seed=0, period=6)
    x, y = ds[1]
    full = torch.cat([x, y[-1:]])
    assert torch.equal(full[6:], full[:-6])
