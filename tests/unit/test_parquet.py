"""Parquet token datasets: the builder, the reader, and their agreement with the byte corpus."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydeep.data import (ByteTokenDataset, ParquetTokenDataset, TokenDatasetError, build_byte_dataset, builtin_dataset,
                          describe_token_dataset, write_token_parquet)
from raydeep.data.parquet import TOKEN_COLUMN


def test_text_files_become_byte_samples(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"hello world, ")
    b.write_bytes(b"and goodbye!")
    out = str(tmp_path / "ds.parquet")
    count = build_byte_dataset(out, [str(a), str(b)], block_size=4)
    text = b"hello world, \nand goodbye!\n"
    assert count == len(text) // 5
    ds = ParquetTokenDataset(out)
    assert (len(ds), ds.block_size, ds.vocab_size) == (count, 4, 256)
    for i in range(count):
        x, y = ds[i]
        window = text[i * 5:(i + 1) * 5]
        assert bytes(x.tolist()) == window[:-1] and bytes(y.tolist()) == window[1:]
        assert x.dtype == torch.int64


def test_one_fixed_size_list_column(tmp_path):
    out = str(tmp_path / "ds.parquet")
    build_byte_dataset(out, block_size=8, max_bytes=9 * 4)
    table = pq.read_table(out)
    assert table.column_names == [TOKEN_COLUMN]
    assert table.schema.field(TOKEN_COLUMN).type.list_size == 9


def test_default_build_matches_the_embedded_corpus(tmp_path):
    out = str(tmp_path / "corpus.parquet")
    build_byte_dataset(out, block_size=32, max_bytes=33 * 50 + 7)
    parquet, reference = ParquetTokenDataset(out), builtin_dataset(32, max_bytes=33 * 50 + 7)
    assert len(parquet) == len(reference) == 50
    for i in (0, 17, 49):
        assert all(torch.equal(p, r) for p, r in zip(parquet[i], reference[i]))


def test_directory_reads_files_in_sorted_order(tmp_path):
    rows = np.arange(30, dtype=np.int64).reshape(10, 3)
    write_token_parquet(rows[5:], str(tmp_path / "d" / "part-1.parquet"), vocab_size=100)
    write_token_parquet(rows[:5], str(tmp_path / "d" / "part-0.parquet"), vocab_size=100)
    ds = ParquetTokenDataset(str(tmp_path / "d"))
    assert len(ds) == 10 and ds.block_size == 2
    got = np.stack([np.concatenate([x[:1].numpy(), y.numpy()]) for x, y in (ds[i] for i in range(10))])
    assert np.array_equal(got, rows)


def test_large_vocabulary_and_uri(tmp_path):
    rows = np.array([[0, 70_000, 123_456], [5, 6, 7]])
    write_token_parquet(rows, f"file://{tmp_path}/big.parquet", vocab_size=200_000)
    ds = ParquetTokenDataset(f"file://{tmp_path}/big.parquet")
    assert ds.vocab_size == 200_000
    assert ds[0][0].tolist() == [0, 70_000] and ds[0][1].tolist() == [70_000, 123_456]


@pytest.mark.parametrize("rows, vocab, message", [
    (np.array([[1, 2, 300]]), 256, "token ids"),
    (np.array([1, 2, 3]), 256, "shape"),
])
def test_bad_samples_are_refused(tmp_path, rows, vocab, message):
    with pytest.raises(ValueError, match=message):
        write_token_parquet(rows, str(tmp_path / "x.parquet"), vocab_size=vocab)


@pytest.mark.parametrize("read", [ParquetTokenDataset, describe_token_dataset], ids=["reader", "describe"])
def test_mixed_sample_lengths_are_refused(tmp_path, read):
    write_token_parquet(np.zeros((2, 3)), str(tmp_path / "d" / "a.parquet"), vocab_size=10)
    write_token_parquet(np.zeros((2, 4)), str(tmp_path / "d" / "b.parquet"), vocab_size=10)
    with pytest.raises(TokenDatasetError, match="tokens") as info:
        read(str(tmp_path / "d"))
    assert info.value.file.endswith("b.parquet")


def test_describe_reads_footers_only(tmp_path):
    rows = np.arange(40, dtype=np.int64).reshape(10, 4)
    write_token_parquet(rows[:6], str(tmp_path / "d" / "part-0.parquet"), vocab_size=100)
    write_token_parquet(rows[6:] + 50, str(tmp_path / "d" / "part-1.parquet"), vocab_size=100)
    info = describe_token_dataset(str(tmp_path / "d"))
    assert (info.num_samples, info.block_size, info.vocab_size) == (10, 3, 100)
    assert (info.min_token, info.max_token, info.exact) == (0, 89, True)  # from row-group statistics
    assert [name.rsplit("/", 1)[1] for name in info.files] == ["part-0.parquet", "part-1.parquet"]


def test_describe_without_statistics_reads_a_bounded_sample(tmp_path):
    rows = np.arange(60, dtype=np.int32).reshape(12, 5)
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 5)
    pq.write_table(pa.table({"tokens": column}), tmp_path / "plain.parquet", write_statistics=False)
    info = describe_token_dataset(str(tmp_path / "plain.parquet"), sample_rows=3)
    assert (info.num_samples, info.block_size, info.vocab_size, info.exact) == (12, 4, None, False)
    assert (info.min_token, info.max_token) == (0, 14)  # the first three rows only
    assert ParquetTokenDataset(str(tmp_path / "plain.parquet")).token_range() == (0, 59)


@pytest.mark.parametrize("read", [ParquetTokenDataset, describe_token_dataset], ids=["reader", "describe"])
def test_files_that_are_no_token_dataset_name_the_file(tmp_path, read):
    (tmp_path / "junk.parquet").write_bytes(b"PAR1" + bytes(100))
    with pytest.raises(TokenDatasetError, match="not a readable Parquet file") as info:
        read(str(tmp_path / "junk.parquet"))
    assert info.value.file == str(tmp_path / "junk.parquet") and "raydeep data build" in info.value.fix
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.file, again.problem, again.fix) == (info.value.file, info.value.problem, info.value.fix)
    pq.write_table(pa.table({"tokens": pa.array(["text"])}), tmp_path / "text.parquet")
    with pytest.raises(TokenDatasetError, match="fixed-size lists of integer token ids"):
        read(str(tmp_path / "text.parquet"))


def test_missing_dataset_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ParquetTokenDataset(str(tmp_path / "nowhere"))


def test_same_windows_as_byte_token_dataset(tmp_path):
    data = bytes(range(256)) * 3
    (tmp_path / "t.bin").write_bytes(data)
    build_byte_dataset(str(tmp_path / "t.parquet"), [str(tmp_path / "t.bin")], block_size=16)
    parquet, reference = ParquetTokenDataset(str(tmp_path / "t.parquet")), ByteTokenDataset(data + b"\n", 16)
    assert len(parquet) == len(reference)
    assert all(torch.equal(parquet[i][0], reference[i][0]) for i in range(len(reference)))
