"""Parquet token datasets: the builder, the reader, and their agreement with the byte corpus."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raydeep.data import ByteTokenDataset, ParquetTokenDataset, build_byte_dataset, builtin_dataset, write_token_parquet
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


def test_mixed_sample_lengths_are_refused(tmp_path):
    write_token_parquet(np.zeros((2, 3)), str(tmp_path / "d" / "a.parquet"), vocab_size=10)
    write_token_parquet(np.zeros((2, 4)), str(tmp_path / "d" / "b.parquet"), vocab_size=10)
    with pytest.raises(ValueError, match="tokens"):
        ParquetTokenDataset(str(tmp_path / "d"))


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
