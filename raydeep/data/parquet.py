"""Token datasets stored as Parquet: one column of fixed-length token-id lists, one row per sample.

A row holds ``block_size + 1`` token ids (the model's inputs and, shifted by one, its targets),
so sample ``i`` is row ``i`` of the files in sorted path order, the same on every worker and
every attempt: the runtime's sample ledger can address samples by index. The schema metadata
records ``block_size``, ``vocab_size`` and the tokenizer, so a dataset describes itself.

Paths may be local or any URI ``pyarrow.fs`` understands (``s3://``, ``gs://``, ``hdfs://``), a
file or a directory of ``*.parquet`` files. The builder tokenises local text files to bytes
(vocabulary 256) — by default the embedded corpus, the Python standard library's sources.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "corpus.parquet")
>>> build_byte_dataset(path, block_size=32, max_bytes=33 * 5)
5
>>> ds = ParquetTokenDataset(path)
>>> len(ds), ds.block_size, ds.vocab_size
(5, 32, 256)
>>> x, y = ds[0]
>>> bool((x[1:] == y[:-1]).all()), x.dtype
(True, torch.int64)
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raydeep.data.corpus import builtin_corpus_bytes

__all__ = ["TOKEN_COLUMN", "ParquetTokenDataset", "write_token_parquet", "build_byte_dataset"]

TOKEN_COLUMN = "tokens"
_META_KEY = b"raydeep"
_ROWS_PER_GROUP = 8192  # row groups of a few MiB: readers can fetch part of a large file


def _resolve(path: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)


def _files(fs: pafs.FileSystem, path: str) -> list[str]:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"no Parquet dataset at {path!r}")
    if info.type == pafs.FileType.File:
        return [path]
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(".parquet"))
    if not files:
        raise FileNotFoundError(f"no *.parquet files under {path!r}")
    return files


def write_token_parquet(samples: np.ndarray, path: str, vocab_size: int, tokenizer: str = "bytes",
                        source: str = "") -> int:
    """Write ``samples`` (shape ``(N, block_size + 1)``) to one Parquet file; returns ``N``."""
    samples = np.asarray(samples)
    if samples.ndim != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must have shape (N, block_size + 1) with block_size >= 1, got {samples.shape}")
    if samples.size and (samples.min() < 0 or samples.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    width = samples.shape[1]
    values = pa.array(samples.astype(dtype, copy=False).reshape(-1))
    column = pa.FixedSizeListArray.from_arrays(values, width)
    meta = {"block_size": width - 1, "vocab_size": vocab_size, "tokenizer": tokenizer, "source": source}
    table = pa.table({TOKEN_COLUMN: column}).replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    fs, fs_path = _resolve(path)
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent:
        fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(fs_path) as sink:
        pq.write_table(table, sink, row_group_size=_ROWS_PER_GROUP)
    return len(samples)


def build_byte_dataset(path: str, text_files: list[str] | None = None, block_size: int = 128,
                       max_bytes: int | None = None) -> int:
    """Tokenise local text files to bytes and write them as fixed-length samples; returns the count.

    Without ``text_files`` the embedded corpus is used. Files are concatenated in the given order
    (joined by a newline) and cut into non-overlapping windows of ``block_size + 1`` tokens; the
    trailing partial window is dropped, as :class:`~raydeep.data.ByteTokenDataset` does.
    """
    if text_files:
        chunks = []
        for name in text_files:
            with open(name, "rb") as fh:
                chunks.append(fh.read() + b"\n")
        data = b"".join(chunks)[:max_bytes]
        source = ",".join(text_files)
    else:
        data = builtin_corpus_bytes(max_bytes) if max_bytes else builtin_corpus_bytes()
        source = "builtin:python-stdlib"
    width = block_size + 1
    count = len(data) // width
    if count == 0:
        raise ValueError(f"{len(data)} bytes of text make no sample of {width} tokens")
    tokens = np.frombuffer(data, dtype=np.uint8, count=count * width).reshape(count, width)
    return write_token_parquet(tokens, path, vocab_size=256, tokenizer="bytes", source=source)


class ParquetTokenDataset(Dataset):
    """Samples of a Parquet token dataset as ``(x, y)`` int64 pairs (see the module docstring).

    The token column is loaded once into one contiguous array (two bytes a token for vocabularies
    up to 65536), so ``__getitem__`` is a slice.
    """

    def __init__(self, path: str):
        fs, fs_path = _resolve(path)
        blocks, meta = [], None
        for name in _files(fs, fs_path):
            with fs.open_input_file(name) as source:
                table = pq.read_table(source, columns=[TOKEN_COLUMN])
            column = table.column(TOKEN_COLUMN)
            if not pa.types.is_fixed_size_list(column.type):
                raise ValueError(f"{name}: column {TOKEN_COLUMN!r} must be a fixed-size list of token ids, "
                                 f"found {column.type}")
            file_meta = json.loads((table.schema.metadata or {}).get(_META_KEY, b"{}"))
            width = column.type.list_size
            if meta is not None and width != meta["width"]:
                raise ValueError(f"{name}: samples of {width} tokens, other files have {meta['width']}")
            meta = meta or {"width": width, "vocab_size": file_meta.get("vocab_size")}
            flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
            blocks.append(flat.reshape(-1, width))
        self.samples = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        self.block_size = meta["width"] - 1
        self.vocab_size = int(meta["vocab_size"] or int(self.samples.max()) + 1)
        self.path = path

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.from_numpy(self.samples[int(index)].astype(np.int64))
        return row[:-1], row[1:]
