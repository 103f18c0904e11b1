"""DeepSpeed client patterns, written as clients write them, run under DeepSpeed or raydeep.

    torchrun --nproc_per_node 2 client_patterns.py --lib deepspeed|raydeep --out DIR \
        [--patterns documented,ray,bf16] [--stages 0,1,2,3]

``--lib raydeep`` swaps the two imports a client changes (``import raydeep as deepspeed``,
``from raydeep.accelerator import get_accelerator``); nothing else differs. The process group is
set up first with ``init_process_group("gloo")``, as Ray Train's ``TorchTrainer`` sets it up
before the training function runs; ``initialize`` reuses it.

Patterns (each a function below, run for every ZeRO stage):

- ``documented``: DeepSpeed's documented loop, ``loss = engine(batch)``, ``engine.backward(loss)``,
  ``engine.step()``, GAS 2, clipping 1.0, AdamW + WarmupLR; ``save_checkpoint(dir,
  client_state=...)``, training on, then a freshly initialised engine (other initial weights)
  ``load_checkpoint(dir)``s and trains the same steps again.
- ``ray``: Ray Train's DeepSpeed example without Ray Data
  (``python/ray/train/examples/deepspeed/deepspeed_torch_trainer_no_raydata.py``): ``initialize``
  with ``training_data`` and ``collate_fn``, ``get_accelerator().device_name(model.local_rank)``,
  ``outputs = model(**batch)``, ``model.backward(loss)``, then the *client* steps
  ``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``; evaluation under
  ``torch.no_grad``; ``model.save_checkpoint(tmpdir)`` with the default tag into a per-rank
  ``TemporaryDirectory`` each epoch, copied to one shared directory as Ray Train uploads every
  worker's checkpoint directory to one storage path; a new engine then loads that. Records
  what the engine reports after the client stepped its optimizer: ``global_steps``,
  ``micro_steps``, the scheduler's ``get_last_lr()`` and the tags the saves created.
- ``bf16``: ``documented`` with ``bf16`` enabled (ZeRO stage 2 only).

Each rank writes ``DIR/rank<r>.json``; a case that raises records its traceback there and the
next case runs. Rank 0 then prints ``RESULT {"ranks": [rank 0's, rank 1's]}``.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F

VOCAB, SEQ, CLASSES, WIDTH = 64, 8, 4, 32
CLIP = 1.0
BEFORE, AFTER = 3, 2  # pattern 1: optimizer steps before the checkpoint, and after it


def import_library(lib: str):
    """``deepspeed`` and ``get_accelerator`` from the library the client chose."""
    if lib == "raydeep":
        import raydeep as deepspeed
        from raydeep.accelerator import get_accelerator
        return deepspeed, get_accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # The test environment's part, as in tests/dist/deepspeed_peer.py: DeepSpeed's CPU backend
    # JIT-compiles an inference-only shared-memory all-reduce kernel when it starts (minutes of
    # C++ build on a small machine); training collectives go through torch.distributed.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed, get_accelerator


# --- the model: HF-free, keyword arguments in, an object with .loss and .logits out ----------------
class Output(dict):
    """Hugging Face's ModelOutput in miniature: a dict whose keys are also attributes (ZeRO-3's
    module hooks find the tensors in a dict; an opaque object draws DeepSpeed's warning)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.head = torch.nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, input_ids, labels=None):
        # Scaled so the gradient norms come out at 1.4-1.9: clipping at 1.0 acts on every step.
        logits = self.head(F.gelu(self.hidden(4.0 * self.embed(input_ids).mean(dim=1))))
        return Output(loss=None if labels is None else F.cross_entropy(logits, labels), logits=logits)


class BatchLoss(Classifier):
    """The documented loop's model: ``loss = engine(batch)``."""

    def forward(self, batch):
        return super().forward(*batch).loss


def build(cls, seed: int):
    torch.manual_seed(seed)
    return cls()


def samples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` token sequences and labels a model can learn (the first token's class, 1 in 4 flipped)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = tokens[:, 0] % CLASSES
    flip = torch.rand(n, generator=g) < 0.25
    labels[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    return tokens, labels


def config(stage: int, micro: int, gas: int, scheduler: dict, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "gradient_clipping": CLIP, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": scheduler,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                 "stage3_param_persistence_threshold": 100}}
    cfg.update(extra)
    return cfg


def listing(directory: str) -> dict:
    """Top-level entries of a checkpoint directory (directories end in /) and ``latest``'s text."""
    names = sorted(n + "/" if os.path.isdir(os.path.join(directory, n)) else n for n in os.listdir(directory))
    latest = os.path.join(directory, "latest")
    return {"entries": names, "latest": open(latest).read().strip() if os.path.isfile(latest) else None}


def counters(engine) -> dict:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": getattr(engine, "micro_steps", None)}


# --- pattern 1: DeepSpeed's documented loop --------------------------------------------------------
def train_documented(engine, first: int, last: int, rank: int, world: int) -> dict:
    """Optimizer steps ``first``..``last - 1`` of a fixed data stream: each step's global batch is
    ``micro * GAS * world`` samples, micro-step k of rank r takes slice k * world + r."""
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses, lrs, norms = [], [], []
    for step in range(first, last):
        tokens, labels = samples(micro * gas * world, seed=100 + step)
        for k in range(gas):
            lo = (k * world + rank) * micro
            loss = engine((tokens[lo:lo + micro].to(engine.device), labels[lo:lo + micro].to(engine.device)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        lrs.append(engine.get_lr())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "lr": lrs, "grad_norm": [None if n is None else float(n) for n in norms]}


def pattern_documented(deepspeed, get_accelerator, stage: int, out: str, extra: dict | None = None) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = config(stage, 2, 2, {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                            "warmup_num_steps": 4, "warmup_type": "linear"}},
                 **(extra or {}))
    save_dir = os.path.join(out, f"documented{stage}{'_' + '_'.join(extra) if extra else ''}")
    client_state = {"epoch": 1, "note": "documented", "history": [0.5, 0.25]}

    model = build(BatchLoss, seed=0)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=copy.deepcopy(cfg))
    result = {"before": train_documented(engine, 0, BEFORE, rank, world), "at_save": counters(engine)}
    result["saved"] = engine.save_checkpoint(save_dir, client_state=client_state)
    torch.distributed.barrier()
    result["listing"] = listing(save_dir)
    result["continued"] = train_documented(engine, BEFORE, BEFORE + AFTER, rank, world)
    result["end"] = counters(engine)
    engine.destroy()

    model = build(BatchLoss, seed=1)  # other weights: the load has to replace them
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=copy.deepcopy(cfg))
    path, loaded = engine.load_checkpoint(save_dir)
    result["load_path"] = None if path is None else os.path.relpath(str(path), save_dir)
    # DeepSpeed hands back its own keys too (ds_config, param_shapes, ...; at stage 0 even the
    # optimizer's state): keep the client's keys, and only the names of the rest.
    loaded = loaded or {}
    result["client_state_sent"] = client_state
    result["client_state"] = {k: loaded[k] for k in client_state if k in loaded}
    result["client_state_other_keys"] = sorted(k for k in loaded if k not in client_state)
    result["after_load"] = {**counters(engine), "lr": engine.get_lr()}
    result["reloaded"] = train_documented(engine, BEFORE, BEFORE + AFTER, rank, world)
    result["reloaded_end"] = counters(engine)
    engine.destroy()
    return result


# --- pattern 2: Ray Train's DeepSpeed example ------------------------------------------------------
def rows(n: int, seed: int) -> list[dict]:
    """A map-style dataset of rows, as a Hugging Face dataset yields them."""
    tokens, labels = samples(n, seed)
    return [{"tokens": t.tolist(), "label": int(y)} for t, y in zip(tokens, labels)]


def collate_fn(batch: list[dict]) -> dict:
    return {"input_ids": torch.tensor([row["tokens"] for row in batch]),
            "labels": torch.LongTensor([row["label"] for row in batch])}


def last_lr(lr_scheduler):
    try:
        return lr_scheduler.get_last_lr()
    except Exception as err:  # DeepSpeed's WarmupLR asserts before its first step()
        return f"{type(err).__name__}: {err}"


def evaluate(model, eval_dataloader, device) -> tuple[float, int]:
    """The example's evaluation: summed loss and correct predictions over the evaluation set."""
    model.eval()
    eval_loss, correct = 0.0, 0
    for batch in eval_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            outputs = model(**batch)
        eval_loss += outputs.loss.item()
        correct += int((outputs.logits.argmax(dim=-1) == batch["labels"]).sum())
    return eval_loss, correct


def ray_setup(deepspeed, cfg: dict, seed: int):
    model = build(Classifier, seed=seed)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), training_data=rows(40, seed=5),
                                collate_fn=collate_fn, config=copy.deepcopy(cfg))


def pattern_ray(deepspeed, get_accelerator, stage: int, out: str, epochs: int = 2) -> dict:
    # Ray's example: GAS 1, clipping on, AdamW + WarmupLR with only warmup_num_steps set.
    cfg = config(stage, 4, 1, {"type": "WarmupLR", "params": {"warmup_num_steps": 8}})
    eval_dataloader = torch.utils.data.DataLoader(rows(16, seed=7), shuffle=False, collate_fn=collate_fn,
                                                  batch_size=8, drop_last=True)
    model, optimizer, train_dataloader, lr_scheduler = ray_setup(deepspeed, cfg, seed=0)
    device = get_accelerator().device_name(model.local_rank)
    result = {"device": str(device), "global_rank": model.global_rank, "local_rank": model.local_rank,
              "batches_per_epoch": len(train_dataloader), "optimizer_is_engine_optimizer": optimizer is model.optimizer,
              "initial_lr": last_lr(lr_scheduler), "engine_lr": model.get_lr(), "epochs": []}
    # Ray Train uploads every worker's directory to one storage path: the union of the ranks' files.
    uploaded = os.path.join(out, f"ray{stage}_uploaded", "epoch{}")
    for epoch in range(epochs):
        model.train()
        losses, lrs, steps = [], [], []
        for batch in train_dataloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            model.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            lrs.append(last_lr(lr_scheduler))
            steps.append(counters(model))
        eval_loss, correct = evaluate(model, eval_dataloader, device)
        with tempfile.TemporaryDirectory(dir=out) as tmpdir:  # each rank its own, as on a Ray cluster
            saved = model.save_checkpoint(tmpdir)
            torch.distributed.barrier()
            saved_listing = listing(tmpdir)
            shutil.copytree(tmpdir, uploaded.format(epoch), dirs_exist_ok=True)
        result["epochs"].append({"losses": losses, "lr": lrs, "counters": steps, "engine_lr": model.get_lr(),
                                 "eval_loss": eval_loss, "eval_correct": correct, "saved": saved,
                                 "checkpoint": saved_listing, "end": counters(model)})
    model.destroy()
    torch.distributed.barrier()  # every rank's files are uploaded
    try:  # reported apart, so that the training above is still compared when the load fails
        result["restored"] = ray_restore(deepspeed, cfg, uploaded.format(epochs - 1), eval_dataloader, device)
    except Exception:
        result["restored"] = {"error": traceback.format_exc()}
    return result


def ray_restore(deepspeed, cfg: dict, uploaded: str, eval_dataloader, device) -> dict:
    """A new engine (other initial weights) loads the uploaded checkpoint, as a restarted Ray Train
    run does: what it reports, and its evaluation (the last epoch's, if the weights came back)."""
    model, _, _, lr_scheduler = ray_setup(deepspeed, cfg, seed=1)
    path, _ = model.load_checkpoint(uploaded)
    eval_loss, correct = evaluate(model, eval_dataloader, device)
    restored = {"load_path": None if path is None else os.path.relpath(str(path), uploaded),
                "counters": counters(model), "lr": last_lr(lr_scheduler), "engine_lr": model.get_lr(),
                "eval_loss": eval_loss, "eval_correct": correct}
    model.destroy()
    return restored


def plain(value):
    """JSON for what an engine may hand back as a tensor (a learning rate, a norm)."""
    if torch.is_tensor(value):
        return value.tolist()
    return repr(value)


PATTERNS = {"documented": pattern_documented, "ray": pattern_ray,
            "bf16": lambda ds, acc, stage, out: pattern_documented(ds, acc, stage, out, {"bf16": {"enabled": True}})}
BF16_STAGES = (2,)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=("deepspeed", "raydeep"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--patterns", default="documented,ray,bf16")
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # As Ray Train's TorchTrainer does before the training function; a short timeout so a rank
    # left waiting in a collective by a failed case fails too instead of hanging the test.
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    deepspeed, get_accelerator = import_library(args.lib)
    stages = [int(s) for s in args.stages.split(",")]
    results, errors = {}, {}
    for name in args.patterns.split(","):
        for stage in stages:
            if name == "bf16" and stage not in BF16_STAGES:
                continue
            try:
                results.setdefault(name, {})[stage] = PATTERNS[name](deepspeed, get_accelerator, stage, args.out)
            except Exception:
                errors[f"{name}/{stage}"] = traceback.format_exc()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"lib": args.lib, "results": results, "errors": errors}, f, default=plain)
    torch.distributed.barrier()
    if rank == 0:
        ranks = []
        for r in range(torch.distributed.get_world_size()):
            with open(os.path.join(args.out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        print("RESULT " + json.dumps({"ranks": ranks}))
    torch.distributed.destroy_process_group()
    # As ds_style_train.py: leave without the interpreter's teardown (a rare gloo abort there).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
