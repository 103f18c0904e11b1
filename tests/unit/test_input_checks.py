"""Run inputs a worker could not use are refused on the driver, before any worker starts.

Each case makes real files in ``tmp_path`` and calls the driver's checks (``TrainSpec``,
``check_workload``, ``plan_run``): one :class:`~raydeep.errors.InputError` naming the input and
its value. One test runs ``raydeep train`` itself and checks it ends with exit 2 and one message
without starting Ray.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydeep.data import build_byte_dataset, describe_token_dataset, write_token_parquet
from raydeep.errors import InputError
from raydeep.ray.spec import TrainSpec, check_storage
from raydeep.ray.workload import check_workload, open_dataset

TINY_BLOCK, TINY_VOCAB = 128, 256  # gpt-tiny's context and vocabulary


def small_vocab_model():
    """A model for ``--model tests.unit.test_input_checks:small_vocab_model``: 64 token ids."""
    from raydeep.models import GPT, gpt_config

    return GPT(gpt_config("gpt-tiny", vocab_size=64, n_layer=1))


def refused(data: str, model: str = "gpt-tiny") -> InputError:
    with pytest.raises(InputError) as info:
        check_workload(model, data, seed=0)
    return info.value


def assert_names(err: InputError, name: str, value: str, *needles: str) -> None:
    text = str(err)
    assert err.name == name and err.value == value and err.fix, text
    assert text.startswith(f"{name} = {value!r}: ") and "Fix: " in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def token_table(column: pa.Array) -> pa.Table:
    return pa.table({"tokens": column})


# --- files that are no token dataset --------------------------------------------------------------

def test_random_bytes_are_not_a_dataset(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_names(refused(str(path)), "--data", str(path), "not a readable Parquet file", "raydeep data build")


def test_truncated_parquet_file(tmp_path):
    whole, cut = tmp_path / "whole.parquet", tmp_path / "cut.parquet"
    build_byte_dataset(str(whole), block_size=16, max_bytes=17 * 100)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert_names(refused(str(cut)), "--data", str(cut), "not a readable Parquet file")


def test_directory_without_parquet_files(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    notes = str(tmp_path / "notes")
    assert_names(refused(notes), "--data", notes, "a directory without *.parquet files")


def test_missing_path(tmp_path):
    assert_names(refused(str(tmp_path / "nowhere.parquet")), "--data", str(tmp_path / "nowhere.parquet"),
                 "no Parquet dataset: nothing there")


@pytest.mark.parametrize("column, needles", [
    (pa.array(["some text", "more text"]), ("string", "fixed-size lists")),
    (pa.array([[0.5, 1.5, 2.5], [1.0, 2.0, 3.0]], pa.list_(pa.float32(), 3)), ("float", "fixed-size lists")),
    (pa.array([[1, 2, 3], [4, 5]]), ("variable-length lists", "fixed-size lists")),
    (pa.array([[1], [2]], pa.list_(pa.int32(), 1)), ("1 token(s) a row", "block_size + 1 >= 2")),
], ids=["string", "float-list", "variable-length", "one-token"])
def test_wrong_column_type(tmp_path, column, needles):
    path = tmp_path / "bad.parquet"
    pq.write_table(token_table(column), path)
    assert_names(refused(str(path)), "--data", str(path), "'tokens'", *needles)


def test_no_tokens_column(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32(), 2))}), path)
    assert_names(refused(str(path)), "--data", str(path), "no 'tokens' column", "ids")


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(token_table(pa.array([], pa.list_(pa.int32(), 3))), path)
    assert_names(refused(str(path)), "--data", str(path), "no samples")


# --- datasets that do not fit the model -----------------------------------------------------------

def test_block_size_longer_than_the_model_context(tmp_path):
    path = tmp_path / "long.parquet"
    build_byte_dataset(str(path), block_size=2 * TINY_BLOCK, max_bytes=(2 * TINY_BLOCK + 1) * 4)
    assert_names(refused(str(path)), "--data", str(path), f"block size {2 * TINY_BLOCK}",
                 f"model's block size {TINY_BLOCK}", f"--block-size {TINY_BLOCK}")


def test_shorter_samples_fit(tmp_path):
    path = tmp_path / "short.parquet"
    build_byte_dataset(str(path), block_size=32, max_bytes=33 * 4)
    check_workload("gpt-tiny", str(path), seed=0)


def test_token_ids_beyond_the_vocabulary_from_statistics(tmp_path):
    path = tmp_path / "wide.parquet"
    rows = np.arange(40).reshape(10, 4) % 17
    rows[7, 2] = 300
    write_token_parquet(rows, str(path), vocab_size=1000)
    err = refused(str(path))
    assert_names(err, "--data", str(path), "token id 300", "column statistics", f"vocabulary of {TINY_VOCAB}")


def test_token_ids_beyond_the_vocabulary_without_statistics(tmp_path):
    # Written by another tool, without statistics: the driver bounds the ids by a sample.
    path = tmp_path / "nostats.parquet"
    rows = np.full((6, 5), 7, dtype=np.int32)
    rows[0, 3] = 999
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 5)
    pq.write_table(token_table(column), path, write_statistics=False)
    assert_names(refused(str(path)), "--data", str(path), "token id 999", "a sample of the first rows")


def test_negative_token_ids(tmp_path):
    path = tmp_path / "neg.parquet"
    column = pa.FixedSizeListArray.from_arrays(pa.array(np.array([1, -4, 2, 3], dtype=np.int32)), 2)
    pq.write_table(token_table(column), path)
    assert_names(refused(str(path)), "--data", str(path), "token id -4", "negative")


def test_builtin_bytes_need_a_vocabulary_of_256():
    model = f"{__name__}:small_vocab_model"
    assert_names(refused("builtin", model=model), "--data", "builtin", "token id 255", "vocabulary of 64")
    check_workload(model, "synthetic", seed=0)  # synthetic tokens come from the model's own vocabulary


def test_worker_checks_every_token_the_sample_missed(tmp_path):
    """Past the driver's sample, a bad id is still refused when a worker loads the data, with the
    same error type, which survives the trip from a worker to the driver."""
    path = tmp_path / "late.parquet"
    rows = np.full((20, 5), 3, dtype=np.int32)
    rows[19, 1] = 5000
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 5)
    pq.write_table(token_table(column), path, write_statistics=False)
    info = describe_token_dataset(str(path), sample_rows=4)
    assert (info.exact, info.max_token, info.num_samples, info.block_size) == (False, 3, 20, 4)
    with pytest.raises(InputError) as caught:
        open_dataset(str(path), TINY_BLOCK, TINY_VOCAB, seed=0)
    err = pickle.loads(pickle.dumps(caught.value))
    assert_names(err, "--data", str(path), "token id 5000", "every token")


# --- storage and paths ----------------------------------------------------------------------------

def test_storage_path_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    target = str(tmp_path / "afile" / "sub")
    with pytest.raises(InputError) as info:
        TrainSpec(storage_path=target, name="x")
    assert_names(info.value, "--storage-path", target, "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_storage_path_in_a_read_only_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        with pytest.raises(InputError) as info:
            check_storage(str(locked / "runs"))
        assert_names(info.value, "--storage-path", str(locked / "runs"), "cannot write")
    finally:
        locked.chmod(0o755)


def test_storage_check_leaves_nothing_behind(tmp_path):
    (tmp_path / "runs").mkdir()
    check_storage(str(tmp_path / "runs"))
    check_storage(str(tmp_path / "new" / "runs"))
    assert sorted(os.listdir(tmp_path)) == ["runs"] and os.listdir(tmp_path / "runs") == []


def test_relative_data_path_is_resolved_on_the_driver(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    build_byte_dataset("corpus.parquet", block_size=32, max_bytes=33 * 8)
    spec = TrainSpec(data="corpus.parquet", storage_path="runs", name="rel")
    assert spec.data == str(tmp_path / "project" / "corpus.parquet")
    assert spec.storage_path == str(tmp_path / "project" / "runs")
    monkeypatch.chdir(tmp_path)  # a worker's working directory is another one
    check_workload(spec.model, spec.data, spec.seed)
    assert len(open_dataset(spec.data, TINY_BLOCK, TINY_VOCAB, seed=0)) == 8
    uri = f"file://{tmp_path}/project/corpus.parquet"
    assert TrainSpec(data=uri, storage_path=str(tmp_path), name="u").data == uri
    assert TrainSpec(data="synthetic", storage_path=str(tmp_path), name="s").data == "synthetic"


def test_plan_run_refuses_bad_data(tmp_path):
    from raydeep.ray.trainer import plan_run

    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        plan_run(TrainSpec(data=str(path), num_workers=1, steps=1, storage_path=str(tmp_path / "runs"), name="x"))


def test_cli_fails_once_before_ray_starts(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(np.random.default_rng(1).bytes(2048))
    ray_tmp = tmp_path / "ray"  # where a Ray session would be created, had one started
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp)}
    proc = subprocess.run([sys.executable, "-m", "raydeep", "train", "--data", str(corrupt), "--num-workers", "1",
                           "--steps", "1", "--storage-path", str(tmp_path / "runs"), "--name", "x"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--data" in errors[0] and str(corrupt) in errors[0] and "Fix:" in errors[0]
    assert not ray_tmp.exists()
