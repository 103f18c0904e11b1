"""Training data that needs no download: the Python standard library, as bytes.

Every machine that runs the engine already has Python, and therefore the
standard library's ``.py`` sources. Concatenated in a fixed order and read as
byte tokens (vocabulary 256), they make a few megabytes of real, learnable text
for demos, tests and benchmarks.

Datasets here return ``(x, y)`` pairs of int64 tensors, where ``y`` is ``x``
shifted left by one token, and sample ``i`` is always the same tokens, so a
runtime can record exactly which sample ids it consumed and resume from them.

Example:
    >>> from raydeep.data.corpus import builtin_dataset
    >>> ds = builtin_dataset(block_size=64, max_bytes=100_000)
    >>> x, y = ds[0]
    >>> x.shape, y.shape, bool((x[1:] == y[:-1]).all())
    (torch.Size([64]), torch.Size([64]), True)
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "builtin_corpus_files",
    "builtin_corpus_bytes",
    "ByteTokenDataset",
    "SyntheticTokenDataset",
    "synthetic_dataset",
    "builtin_dataset",
]

DEFAULT_CORPUS_BYTES = 4_000_000

# Directories whose presence or content depends on how Python was packaged or
# what the user installed, not on the Python version: skipping them keeps the
# corpus identical across machines running the same Python release.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload"}
)
# _sysconfigdata_*.py records the build machine's compiler flags and paths.
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)


def _stdlib_dir() -> str:
    # os.py lives at the root of the pure-Python standard library on every
    # regular CPython install, including inside virtualenvs.
    return os.path.dirname(os.path.abspath(os.__file__))


def builtin_corpus_files() -> list[str]:
    """Standard-library ``.py`` files in corpus order, as paths relative to the stdlib root.

    Top-level modules come first (sorted by name), then each package's files,
    walking directories in sorted order.

    Example:
        >>> builtin_corpus_files()[0]
        '__future__.py'
    """
    root = _stdlib_dir()
    if not os.path.isdir(root):
        raise RuntimeError(f"standard library sources not found as a directory at {root!r}")
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's traversal order, which otherwise
        # follows the filesystem's arbitrary directory order.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and "-" not in d)
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith(_SKIP_FILE_PREFIXES):
                files.append(name if rel == "." else os.path.join(rel, name))
    return files


@functools.lru_cache(maxsize=8)
def builtin_corpus_bytes(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """Concatenated standard-library sources, truncated to at most ``max_bytes``.

    Deterministic: the same Python version gives the same bytes. Files are
    joined with a newline; the last file is cut mid-way to hit ``max_bytes``.

    Example:
        >>> data = builtin_corpus_bytes(10_000)
        >>> len(data), data == builtin_corpus_bytes(10_000)
        (10000, True)
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = _stdlib_dir()
    chunks: list[bytes] = []
    size = 0
    for rel in builtin_corpus_files():
        with open(os.path.join(root, rel), "rb") as fh:
            chunk = fh.read() + b"\n"
        chunks.append(chunk[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    if size == 0:
        raise RuntimeError(f"no standard-library .py sources found under {root!r}")
    return b"".join(chunks)


def _as_uint8_tensor(data: bytes | bytearray | np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        tokens = data.detach().reshape(-1).cpu()
    elif isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data).reshape(-1)
        # torch cannot wrap read-only memory (e.g. np.frombuffer over bytes) safely.
        tokens = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    else:
        # frombuffer on a read-only bytes object would warn; bytearray copies it.
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if tokens.dtype != torch.uint8:
        raise TypeError(f"byte tokens must be uint8, got {tokens.dtype}")
    return tokens


class ByteTokenDataset(Dataset):
    """Fixed-length, non-overlapping windows of byte tokens.

    Sample ``i`` covers tokens ``[i * (block_size + 1), (i + 1) * (block_size + 1))``
    and is returned as ``(x, y)``: the first ``block_size`` tokens and the
    ``block_size`` tokens after the first (next-token targets), both int64.
    A trailing partial window is dropped.

    Example:
        >>> ds = ByteTokenDataset(b"abcdefghij", block_size=4)
        >>> len(ds)
        2
        >>> x, y = ds[1]
        >>> bytes(x.tolist()), bytes(y.tolist())
        (b'fghi', b'ghij')
    """

    vocab_size = 256

    def __init__(self, data: bytes | bytearray | np.ndarray | torch.Tensor, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tokens = _as_uint8_tensor(data)
        self.block_size = block_size
        self._window = block_size + 1
        self._len = self.tokens.numel() // self._window

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = _check_index(index, self._len)
        chunk = self.tokens[i * self._window : (i + 1) * self._window].long()
        return chunk[:-1], chunk[1:]


def _check_index(index: int, length: int) -> int:
    i = int(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        # IndexError (not ValueError) so plain iteration over the dataset stops.
        raise IndexError(f"sample index {index} out of range for dataset of length {length}")
    return i


class SyntheticTokenDataset(Dataset):
    """Random token sequences, generated on demand from ``(seed, index)``.

    Nothing is stored, so the dataset can be arbitrarily long and every worker
    sees identical samples. With ``period == 0`` tokens are i.i.d. uniform
    (loss cannot go below ln(vocab): a pure throughput workload). With
    ``period > 0`` each sample repeats a random pattern of that length, which a
    model can learn to copy, so loss falls well below ln(vocab).

    Example:
        >>> ds = SyntheticTokenDataset(4, block_size=8, vocab_size=100, seed=0, period=3)
        >>> x, y = ds[0]
        >>> bool((x[3:] == x[:-3]).all()), bool((x[1:] == y[:-1]).all())
        (True, True)
    """

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 0, period: int = 0) -> None:
        if num_samples < 0 or block_size <= 0 or vocab_size <= 0 or period < 0:
            raise ValueError("num_samples must be >= 0; block_size, vocab_size positive; period >= 0")
        self.num_samples = num_samples
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.period = period

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = _check_index(index, self.num_samples)
        gen = torch.Generator()
        # Mix seed and index so that (seed, i) streams do not collide for
        # neighbouring seeds (seed s, index i+1 vs seed s+1, index i).
        gen.manual_seed((self.seed * 1_000_003 + i) % (2**63))
        length = self.block_size + 1
        if self.period == 0:
            seq = torch.randint(self.vocab_size, (length,), generator=gen)
        else:
            pattern = torch.randint(self.vocab_size, (self.period,), generator=gen)
            seq = pattern.repeat(-(-length // self.period))[:length]
        return seq[:-1], seq[1:]


def synthetic_dataset(
    num_samples: int, block_size: int, vocab_size: int, seed: int = 0, period: int = 0
) -> SyntheticTokenDataset:
    """Deterministic random-token dataset with the ``(x, y)`` contract.

    Example:
        >>> ds = synthetic_dataset(10, block_size=16, vocab_size=4096, seed=1)
        >>> x, y = ds[3]
        >>> x.dtype, x.shape, bool((x == ds[3][0]).all())
        (torch.int64, torch.Size([16]), True)
    """
    return SyntheticTokenDataset(num_samples, block_size, vocab_size, seed=seed, period=period)


def builtin_dataset(block_size: int, max_bytes: int = DEFAULT_CORPUS_BYTES) -> ByteTokenDataset:
    """Byte-token dataset over :func:`builtin_corpus_bytes`.

    Example:
        >>> ds = builtin_dataset(block_size=128, max_bytes=129 * 10)
        >>> len(ds)
        10
    """
    return ByteTokenDataset(builtin_corpus_bytes(max_bytes), block_size)
