"""Find the files of one DeepSpeed ZeRO checkpoint (one model-parallel rank) and check they are complete."""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from raydeep.errors import CheckpointError

_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class DeepSpeedFiles:
    tag: str
    directory: str                    # <save_dir>/<tag>
    model_files: list[str]            # one (stages 1-2) or one per rank (stage 3), rank order
    optim_files: list[str]            # one per data-parallel rank, rank order


def _natural(text: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def locate(src: str, tag: str | None = None) -> DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint: ``src`` is the save directory (its ``latest``
    names the tag unless ``tag`` is given) or a tag directory itself."""
    if "://" in src:
        raise CheckpointError(f"{src}: DeepSpeed checkpoints are read from a local directory; copy it locally first")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a directory: pass the directory given to DeepSpeed's save_checkpoint")
    if tag is None and os.path.isfile(os.path.join(src, "latest")):
        with open(os.path.join(src, "latest")) as f:
            tag = f.read().strip()
    if tag is not None:
        directory = os.path.join(src, tag)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory} does not exist (tag {tag!r})")
    elif glob.glob(os.path.join(src, "*_model_states.pt")) or glob.glob(os.path.join(src, "*_optim_states.pt")):
        directory, tag = src, os.path.basename(os.path.normpath(src))
    else:
        raise CheckpointError(f"{src} is not a DeepSpeed checkpoint: it has no 'latest' file and no "
                              "*_states.pt files; pass --tag or the tag directory")
    names = sorted(os.listdir(directory), key=_natural)
    if any(n.startswith("expp_rank_") or n.startswith("layer_") for n in names):
        raise CheckpointError(f"{directory} holds mixture-of-experts or pipeline-parallel files "
                              "(expp_rank_*/layer_*): only data-parallel ZeRO checkpoints can be imported")
    optim = [n for n in names if _OPTIM_FILE.match(n)]
    if any(_OPTIM_FILE.match(n).group(3) != "00" for n in optim):
        raise CheckpointError(f"{directory} has tensor-parallel ranks (mp_rank_01...): only mp_rank_00 "
                              "checkpoints can be imported")
    if not optim:
        raise CheckpointError(f"{directory} has no *_optim_states.pt files: not a ZeRO checkpoint "
                              "(stage 0 saves no optimizer partitions)")
    ranks = sorted(int(_OPTIM_FILE.match(n).group(2)) for n in optim)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointError(f"{directory}: optimizer files of data-parallel rank(s) {missing} are missing")
    optim.sort(key=lambda n: int(_OPTIM_FILE.match(n).group(2)))
    stage3 = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks]
    if all(n in names for n in stage3):
        models = stage3
    elif "mp_rank_00_model_states.pt" in names:
        models = ["mp_rank_00_model_states.pt"]
    else:
        raise CheckpointError(f"{directory}: model states file missing (mp_rank_00_model_states.pt for stages 1-2, "
                              "zero_pp_rank_<r>_mp_rank_00_model_states.pt for every rank at stage 3)")
    return DeepSpeedFiles(tag, directory, [os.path.join(directory, n) for n in models],
                          [os.path.join(directory, n) for n in optim])
