"""The checkpoint format without an engine: commit, ranges, digests, retention, bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch

from raydeep.checkpoint import CheckpointReader, Storage, committed_tags, prune, write_single
from raydeep.checkpoint import format as fmt
from raydeep.errors import CheckpointError

WEIGHTS = {"w": torch.arange(12.0).view(3, 4), "b": torch.tensor([0.5, -0.5])}


def _write(directory, tag="t", steps=0, **kw):
    write_single(str(directory), tag, WEIGHTS, states={"exp_avg": {n: t * 2 for n, t in WEIGHTS.items()}},
                 counters={"global_steps": steps}, **kw)


def test_round_trip_ranges_and_full(tmp_path):
    _write(tmp_path)
    reader = CheckpointReader.open(str(tmp_path))
    assert reader.tag == "t" and (tmp_path / "latest").read_text() == "t"
    assert torch.equal(reader.full("fp32", "w"), WEIGHTS["w"])
    assert torch.equal(reader.read_range("exp_avg", "w", 5, 9), torch.arange(5.0, 9.0) * 2)
    assert reader.state_kinds == ["fp32", "exp_avg"]
    reader.verify_all()


def test_staging_directory_is_gone_after_commit(tmp_path):
    _write(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    assert sorted(os.listdir(tmp_path / "t")) == ["manifest.json", fmt.rank_file(0, 1)]


@pytest.mark.parametrize("damage", ["bit-flip", "truncate"])
def test_corrupt_file_is_named_with_both_digests(tmp_path, damage):
    _write(tmp_path)
    path = tmp_path / "t" / fmt.rank_file(0, 1)
    data = bytearray(path.read_bytes())
    expected = fmt.sha256(bytes(data))
    if damage == "bit-flip":
        data[-3] ^= 0x10
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        CheckpointReader.open(str(tmp_path)).full("fp32", "w")
    message = str(err.value)
    assert fmt.rank_file(0, 1) in message and expected in message and fmt.sha256(bytes(data)) in message


def test_uncommitted_tag_is_refused(tmp_path):
    _write(tmp_path)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / fmt.rank_file(0, 1)).write_bytes(b"partial")
    with pytest.raises(CheckpointError, match="never committed"):
        CheckpointReader.open(str(tmp_path), tag="half")
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader.open(str(tmp_path), tag="nope")
    assert [tag for _, tag in committed_tags(Storage.open(str(tmp_path)))] == ["t"]


def test_missing_latest_and_bad_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="latest does not exist"):
        CheckpointReader.open(str(tmp_path))
    _write(tmp_path)
    (tmp_path / "t" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        CheckpointReader.open(str(tmp_path))


def test_manifest_is_plain_json_with_digests(tmp_path):
    _write(tmp_path)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    entry = manifest["files"][fmt.rank_file(0, 1)]
    assert entry["sha256"] == fmt.sha256((tmp_path / "t" / fmt.rank_file(0, 1)).read_bytes())
    assert sorted(map(tuple, entry["pieces"])) == [("b", 0, 2, 12), ("w", 0, 12, 0)]
    assert manifest["params"]["w"]["shape"] == [3, 4]


def test_keep_last_k_keeps_the_newest_and_latest(tmp_path):
    for steps in (1, 2, 3, 4):
        _write(tmp_path, tag=f"global_step{steps}", steps=steps)
    removed = prune(Storage.open(str(tmp_path)), keep_last_k=2)
    assert removed == ["global_step1", "global_step2"]
    assert sorted(os.listdir(tmp_path)) == ["global_step3", "global_step4", "latest"]
    # ``latest`` is never pruned, even when it is older than the newest K.
    (tmp_path / "latest").write_text("global_step3")
    _write(tmp_path, tag="global_step5", steps=5, save_latest=False)
    prune(Storage.open(str(tmp_path)), keep_last_k=1)
    assert sorted(os.listdir(tmp_path)) == ["global_step3", "global_step5", "latest"]


def test_resaving_a_tag_replaces_it(tmp_path):
    _write(tmp_path)
    write_single(str(tmp_path), "t", {"w": torch.zeros(3, 4), "b": torch.zeros(2)})
    assert torch.equal(CheckpointReader.open(str(tmp_path)).full("fp32", "w"), torch.zeros(3, 4))
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


def test_bad_tags_and_paths(tmp_path):
    with pytest.raises(ValueError, match="tag"):
        write_single(str(tmp_path), "a/b", WEIGHTS)
    with pytest.raises(ValueError, match="empty"):
        Storage.open("")


def test_file_uri(tmp_path):
    _write(f"file://{tmp_path}")
    assert torch.equal(CheckpointReader.open(str(tmp_path)).full("fp32", "b"), WEIGHTS["b"])


def test_leftovers_of_interrupted_saves_are_removed_at_the_next_commit(tmp_path):
    (tmp_path / ".crashed.staging").mkdir(parents=True)
    (tmp_path / ".crashed.staging" / "rank00000-of-00001.safetensors").write_bytes(b"half")
    _write(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


def test_encoded_files_are_safetensors_for_every_dtype_and_shape():
    from safetensors.torch import load

    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(), "f16": torch.randn(2, 2).half(),
               "i64": torch.arange(7), "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
               "flag": torch.tensor([True, False]), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)}
    chunks = fmt.encode(tensors)
    data = b"".join(bytes(c) for c in chunks)
    assert fmt.encoded_size(chunks) == len(data) and fmt.sha256(chunks) == fmt.sha256(data)
    back = load(data)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
