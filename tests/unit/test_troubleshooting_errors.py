"""Failures the troubleshooting guide promises a clear outcome for: a DeepSpeed checkpoint given
to raydeep's loader says what it is and how to convert it; a loss-scale collapse ends a Ray Train
run at once (every retry would replay the same batches into it)."""
import pytest

from raydeep.checkpoint.reader import CheckpointReader
from raydeep.errors import CheckpointError
from raydeep.precision.diagnosis import LossScaleCollapse
from raydeep.ray.failures import deterministic_error


@pytest.mark.parametrize("shard", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"])
def test_a_deepspeed_checkpoint_names_the_conversion(tmp_path, shard):
    (tmp_path / "latest").write_text("global_step7")
    (tmp_path / "global_step7").mkdir()
    (tmp_path / "global_step7" / shard).write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint") as caught:
        CheckpointReader.open(str(tmp_path))
    assert "raydeep convert import-deepspeed" in str(caught.value) and "--tag global_step7" in str(caught.value)


def test_an_unfinished_raydeep_save_is_still_called_uncommitted(tmp_path):
    (tmp_path / "latest").write_text("global_step7")
    (tmp_path / "global_step7").mkdir()
    with pytest.raises(CheckpointError, match="never committed"):
        CheckpointReader.open(str(tmp_path))


def test_loss_scale_collapse_is_not_retried():
    collapse = LossScaleCollapse("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
    assert deterministic_error(collapse) is collapse
    assert isinstance(collapse, Exception)  # `except Exception` around DeepSpeed's raise still catches it
