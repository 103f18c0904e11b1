"""What the Hugging Face runs share, on DeepSpeed and on raydeep alike: the ``deepspeed``
import for each backend, accelerate's process state on gloo, a tiny GPT-2 built from a config
(nothing is downloaded) under a fixed seed, and a synthetic token dataset (no tokenizer).

Imported by top-level name from the scripts in this folder (a launched script's folder is first
on ``sys.path``).
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings

VOCAB, SEQ = 96, 16


class HideDeepSpeed:
    """A ``sys.meta_path`` entry that makes an installed DeepSpeed unimportable.

    ``raydeep.compat.install()`` refuses to pose as DeepSpeed where DeepSpeed is installed. A test
    environment holding both (CI's, with the ``peers`` extra) runs the raydeep half behind this
    blocker: install() then finds no DeepSpeed and puts its finder ahead of the blocker, so every
    ``deepspeed`` module comes from raydeep (the script reports each one's file, and the test
    checks them) and an import that slipped past raydeep would fail instead of using DeepSpeed.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "deepspeed":  # its submodules are reached through the package it would return
            raise ModuleNotFoundError("No module named 'deepspeed' (hidden for this run)", name=fullname)
        return None


def backend(name: str, hide_installed: bool = False):
    """Import ``deepspeed`` for ``name`` (``"deepspeed"`` or ``"raydeep"``); returns the module.
    For raydeep the compatibility finder goes in first, before transformers decides (at its
    import) whether DeepSpeed exists."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if name == "raydeep":
        import raydeep.compat

        if hide_installed:
            sys.meta_path.insert(0, HideDeepSpeed())
        raydeep.compat.install()
    import deepspeed

    if name == "deepspeed":
        # DeepSpeed's CPU comm backend JIT-builds a shared-memory all-reduce kernel that only
        # inference uses: skip minutes of C++ build (see tests/dist/deepspeed_peer.py).
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


def deepspeed_state_on_gloo() -> None:
    """Set up accelerate's process state for DeepSpeed over gloo, as a CPU-only machine needs.

    ``TrainingArguments(deepspeed=...)`` asks accelerate for a DeepSpeed state without naming a
    backend (``ddp_backend`` is ignored there), and with no accelerator device accelerate picks
    none and counts one process. Made here first, the Trainer takes it (``use_configured_state``)
    and so does ``Accelerator()``.
    """
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


class TokenData:
    """Token sequences ``start, start + stride, ...`` (mod the vocabulary) with a random start and
    one of a few strides: learnable, so the loss falls steadily and a wrong update shows. The
    labels are the inputs (GPT-2 shifts them itself)."""

    def __init__(self, count: int, seed: int = 1):
        import torch

        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=g)
        stride = torch.randint(1, 4, (count, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    """Built as Hugging Face scripts build a model from scratch (``from_config``): under a ZeRO-3
    ds_config, after ``TrainingArguments``, that is inside ``deepspeed.zero.Init``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def deepspeed_files() -> list[str]:
    """The file of every ``deepspeed`` module this process loaded."""
    return sorted({getattr(m, "__file__", None) or "" for name, m in list(sys.modules.items())
                   if name == "deepspeed" or name.startswith("deepspeed.")})
