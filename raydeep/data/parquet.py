"""Token datasets stored as Parquet: one column of fixed-length token-id lists, one row per sample.

A row holds ``block_size + 1`` token ids (the model's inputs and, shifted by one, its targets),
so sample ``i`` is row ``i`` of the files in sorted path order, the same on every worker and
every attempt: the runtime's sample ledger can address samples by index. The schema metadata
records ``block_size``, ``vocab_size`` and the tokenizer, so a dataset describes itself.

Paths may be local or any URI ``pyarrow.fs`` understands (``s3://``, ``gs://``, ``hdfs://``), a
file or a directory of ``*.parquet`` files. The builder tokenises local text files to bytes
(vocabulary 256) — by default the embedded corpus, the Python standard library's sources.
:func:`describe_token_dataset` checks a dataset from its Parquet footers alone, so a driver can
refuse a bad one before any worker reads it.

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
>>> info = describe_token_dataset(path)
>>> info.num_samples, info.block_size, info.exact, info.max_token < 256
(5, 32, True, True)
"""
from __future__ import annotations

import errno
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raydeep.data.corpus import builtin_corpus_bytes

__all__ = ["TOKEN_COLUMN", "ParquetTokenDataset", "TokenDatasetError", "TokenDatasetInfo", "build_byte_dataset",
           "describe_token_dataset", "write_token_parquet"]

TOKEN_COLUMN = "tokens"
_META_KEY = b"raydeep"
_ROWS_PER_GROUP = 8192  # row groups of a few MiB: readers can fetch part of a large file
SAMPLE_ROWS = 8192  # rows read to bound the token ids of files written without column statistics
_REBUILD_FIX = "rebuild it with `raydeep data build` or raydeep.data.write_token_parquet"


class TokenDatasetError(ValueError):
    """A file (or dataset path) that is no usable token dataset: ``str()`` is ``"<file>: <problem>"``,
    ``fix`` says what to do."""

    def __init__(self, file: str, problem: str, fix: str = _REBUILD_FIX):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem, self.fix = file, problem, fix

    def __reduce__(self):
        return (type(self), (self.file, self.problem, self.fix))


@dataclass(frozen=True)
class TokenDatasetInfo:
    """What a token dataset's footers say: enough to decide whether it fits a model."""

    files: tuple[str, ...]
    num_samples: int
    block_size: int
    vocab_size: int | None  # as the schema metadata declares it (None: not declared)
    min_token: int
    max_token: int
    exact: bool  # token range from every row group's statistics; False: from a sample of the rows


def _resolve(path: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)


def _files(fs: pafs.FileSystem, path: str) -> list[str]:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(errno.ENOENT, "no Parquet dataset: nothing there", path)
    if info.type == pafs.FileType.File:
        return [path]
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(".parquet"))
    if not files:
        raise FileNotFoundError(errno.ENOENT, "no Parquet dataset: a directory without *.parquet files", path)
    return files


def _token_width(schema: pa.Schema, name: str) -> int:
    """Tokens per row (``block_size + 1``), or a :class:`TokenDatasetError` naming what is wrong."""
    if TOKEN_COLUMN not in schema.names:
        raise TokenDatasetError(name, f"no {TOKEN_COLUMN!r} column (it has {', '.join(schema.names) or 'none'})")
    kind = schema.field(TOKEN_COLUMN).type
    if not (pa.types.is_fixed_size_list(kind) and pa.types.is_integer(kind.value_type)):
        variable = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_list_view(kind)
        what = "variable-length lists" if variable else "not a list of token ids"
        raise TokenDatasetError(name, f"column {TOKEN_COLUMN!r} is {kind} ({what}); a token dataset needs "
                                "fixed-size lists of integer token ids, block_size + 1 per row")
    if kind.list_size < 2:
        raise TokenDatasetError(name, f"column {TOKEN_COLUMN!r} holds {kind.list_size} token(s) a row; a sample "
                                "needs block_size + 1 >= 2")
    return kind.list_size


def _declared_vocab(schema: pa.Schema) -> int | None:
    try:
        return json.loads((schema.metadata or {}).get(_META_KEY, b"{}")).get("vocab_size")
    except (ValueError, AttributeError):
        return None  # metadata written by another tool: the token ids alone decide


def _statistics_range(meta: pq.FileMetaData, name: str) -> tuple[int, int] | None:
    """(min, max) token id over every row group, or None when a row group has no statistics."""
    column = next(i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == TOKEN_COLUMN)
    low, high = None, None
    for group in range(meta.num_row_groups):
        stats = meta.row_group(group).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        if stats.null_count:
            raise TokenDatasetError(name, f"holds {stats.null_count} null token ids")
        low = stats.min if low is None else min(low, stats.min)
        high = stats.max if high is None else max(high, stats.max)
    return (int(low), int(high)) if low is not None else None


def _sample_range(parquet: pq.ParquetFile, name: str, rows: int) -> tuple[int, int] | None:
    """(min, max) token id of the first ``rows`` rows, read only when statistics are absent."""
    batch = next(parquet.iter_batches(batch_size=rows, columns=[TOKEN_COLUMN]), None)
    values = batch.column(0).flatten() if batch is not None and batch.num_rows else None
    if values is None or len(values) == 0:
        return None
    if values.null_count:
        raise TokenDatasetError(name, "holds null token ids")
    flat = values.to_numpy(zero_copy_only=False)
    return int(flat.min()), int(flat.max())


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


@dataclass
class _FileFacts:
    """What one file's footer says (the dataset's facts are these, combined over its files)."""

    width: int
    vocab: int | None
    rows: int
    token_range: tuple[int, int] | None
    exact: bool


def _file_facts(fs: pafs.FileSystem, name: str, sample_rows: int) -> _FileFacts:
    """One file's footer (and, without statistics, a sample of its first rows)."""
    try:
        with fs.open_input_file(name) as source:
            parquet = pq.ParquetFile(source)  # parses the footer: a corrupt or truncated file fails here
            width = _token_width(parquet.schema_arrow, name)
            token_range, exact = _statistics_range(parquet.metadata, name), True
            if token_range is None and parquet.metadata.num_rows:
                exact = False
                token_range = _sample_range(parquet, name, sample_rows) if sample_rows > 0 else None
            return _FileFacts(width, _declared_vocab(parquet.schema_arrow), parquet.metadata.num_rows,
                              token_range, exact)
    except (pa.ArrowException, OSError) as exc:
        raise TokenDatasetError(name, f"not a readable Parquet file ({exc})") from None


def describe_token_dataset(path: str, sample_rows: int = SAMPLE_ROWS) -> TokenDatasetInfo:
    """Check a token dataset from its Parquet footers, without reading its samples.

    The token range comes from the row groups' column statistics (which the builder always
    writes). A file without statistics is bounded by a sample instead: its first rows, at most
    ``sample_rows`` over the whole dataset, so a large remote dataset is never read in full
    here; ``exact`` is then False and the reader checks every token when it loads them.
    Raises ``FileNotFoundError`` (nothing there) or :class:`TokenDatasetError`.
    """
    fs, fs_path = _resolve(path)
    files, facts = _files(fs, fs_path), []
    for name in files:
        facts.append(_file_facts(fs, name, sample_rows))
        if facts[-1].width != facts[0].width:
            raise TokenDatasetError(name, f"samples of {facts[-1].width} tokens, other files have "
                                    f"{facts[0].width}")
        if not facts[-1].exact:
            sample_rows -= min(sample_rows, facts[-1].rows)
    rows = sum(f.rows for f in facts)
    if rows == 0:
        raise TokenDatasetError(path, "holds no samples (0 rows)")
    ranges = [f.token_range for f in facts if f.token_range]
    vocab = next((f.vocab for f in facts if f.vocab), None)
    return TokenDatasetInfo(tuple(files), rows, facts[0].width - 1, vocab, min((r[0] for r in ranges), default=0),
                            max((r[1] for r in ranges), default=0), all(f.exact for f in facts))


def _read_tokens(fs: pafs.FileSystem, name: str) -> tuple[int, int | None, np.ndarray]:
    """One file's (tokens per row, declared vocabulary, every token id as a flat array)."""
    try:
        with fs.open_input_file(name) as source:
            parquet = pq.ParquetFile(source)
            width = _token_width(parquet.schema_arrow, name)  # before reading: name the column's problem
            flat = parquet.read(columns=[TOKEN_COLUMN]).column(0).combine_chunks().flatten()
    except (pa.ArrowException, OSError) as exc:
        raise TokenDatasetError(name, f"not a readable Parquet file ({exc})") from None
    if flat.null_count:
        raise TokenDatasetError(name, f"holds {flat.null_count} null token ids")
    return width, _declared_vocab(parquet.schema_arrow), flat.to_numpy(zero_copy_only=False)


class ParquetTokenDataset(Dataset):
    """Samples of a Parquet token dataset as ``(x, y)`` int64 pairs (see the module docstring).

    The token column is loaded once into one contiguous array (two bytes a token for vocabularies
    up to 65536), so ``__getitem__`` is a slice. A file that is no token dataset raises
    :class:`TokenDatasetError` naming it.
    """

    def __init__(self, path: str):
        fs, fs_path = _resolve(path)
        blocks, width, vocab = [], None, None
        for name in _files(fs, fs_path):
            file_width, file_vocab, tokens = _read_tokens(fs, name)
            if width is not None and file_width != width:
                raise TokenDatasetError(name, f"samples of {file_width} tokens, other files have {width}")
            width, vocab = file_width, vocab or file_vocab
            blocks.append(tokens.reshape(-1, width))
        self.samples = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        if not len(self.samples):
            raise TokenDatasetError(path, "holds no samples (0 rows)")
        self.block_size = width - 1
        self.vocab_size = int(vocab or int(self.samples.max()) + 1)
        self.path = path

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id of every sample: one pass over the loaded array."""
        return int(self.samples.min()), int(self.samples.max())

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.from_numpy(self.samples[int(index)].astype(np.int64))
        return row[:-1], row[1:]
