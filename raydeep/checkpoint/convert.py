"""``raydeep convert``: offline conversions of checkpoints.

    raydeep convert export SRC OUT [--tag T] [--dtype fp32|bf16|fp16] [--format safetensors|torch]
                                   [--max-shard-size 5GB]
    raydeep convert import-deepspeed SRC OUT [--tag T]
    raydeep convert reshard SRC OUT --world-size N [--tag T]

``export`` writes consolidated weights (:mod:`raydeep.checkpoint.export`); ``import-deepspeed``
turns a DeepSpeed ZeRO checkpoint into a raydeep one (:mod:`raydeep.checkpoint.deepspeed_import`);
``reshard`` rewrites a raydeep checkpoint as N rank files. raydeep checkpoints load on any world
size as they are, so ``reshard`` is for tools that want one file per rank of a fixed layout.

A bad input (not a checkpoint, a missing or corrupt file) prints one ``error:`` line naming the
file or key and exits with status 2.
"""
from __future__ import annotations

import argparse
import copy
import sys

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.reader import CheckpointReader
from raydeep.storage import Storage
from raydeep.checkpoint.writer import TagWriter
from raydeep.errors import RaydeepError
from raydeep.zero.layout import UnitLayout


def reshard(src: str, out: str, world_size: int, tag: str | None = None) -> str:
    """Rewrite the committed checkpoint ``src`` (``tag`` or ``latest``) under ``out`` as
    ``world_size`` rank files, each holding an even, contiguous share of all parameters' elements
    (every state kind). Returns the tag, which is committed and written to ``out``'s ``latest``."""
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    reader = CheckpointReader.open(src, tag)
    reader.verify_all()
    layout = UnitLayout.build([(name, tuple(spec["shape"])) for name, spec in reader.params.items()], world_size)
    writer = TagWriter(Storage.open(out), reader.tag)
    writer.prepare()
    files = {}
    for rank in range(world_size):
        packed = fmt.PackedFile()
        for slot, lo, hi in layout.pieces_of_rank(rank):
            packed.add(slot.name, lo, hi, {kind: reader.read_range(kind, slot.name, lo, hi)
                                           for kind in reader.state_kinds})
        name = fmt.rank_file(rank, world_size)
        files[name] = {**writer.write_file(name, fmt.encode(packed.tensors())), "pieces": packed.pieces}
    if fmt.EXTRA_FILE in reader.manifest["files"]:
        files[fmt.EXTRA_FILE] = writer.write_file(fmt.EXTRA_FILE, fmt.encode(reader.extra()))
    manifest = copy.deepcopy(reader.manifest)
    manifest.update(world_size=world_size, files=files)
    writer.commit(manifest)
    return reader.tag


# --- command line --------------------------------------------------------------------------------
def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``convert`` and its three actions to the ``raydeep`` command's subparsers."""
    convert = subparsers.add_parser("convert", help="export, import (DeepSpeed) or reshard checkpoints",
                                    description="Offline checkpoint conversions; see `raydeep convert ACTION -h`.")
    actions = convert.add_subparsers(dest="action", required=True)

    export = actions.add_parser("export", help="consolidated weights (safetensors or a PyTorch state dict)")
    export.add_argument("src", help="raydeep checkpoint directory (the save_dir; path or URI)")
    export.add_argument("out", help="output directory (path or URI)")
    export.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the trainable parameters (default fp32)")
    export.add_argument("--format", dest="formats", action="append", choices=["safetensors", "torch"],
                        help="model.safetensors (default) or pytorch_model.bin; repeat for both")
    export.add_argument("--max-shard-size", default="5GB",
                        help="split into Hugging Face-style shards with an index above this size (default 5GB)")
    export.set_defaults(func=run_convert)

    importer = actions.add_parser("import-deepspeed",
                                  help="a DeepSpeed ZeRO checkpoint (stages 1-3) to raydeep's format")
    importer.add_argument("src", help="DeepSpeed save_dir (with 'latest') or one of its tag directories")
    importer.add_argument("out", help="raydeep checkpoint directory to write (path or URI)")
    importer.add_argument("--tag", help="DeepSpeed tag (default: the one 'latest' names)")
    importer.set_defaults(func=run_convert)

    resharder = actions.add_parser("reshard", help="rewrite a raydeep checkpoint as N rank files")
    resharder.add_argument("src", help="raydeep checkpoint directory (path or URI)")
    resharder.add_argument("out", help="output checkpoint directory (path or URI)")
    resharder.add_argument("--world-size", type=int, required=True, help="number of rank files")
    resharder.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    resharder.set_defaults(func=run_convert)
    return convert


def run_convert(args: argparse.Namespace) -> int:
    """Run one ``raydeep convert`` action; user errors print one line and return 2."""
    try:
        if args.action == "export":
            from raydeep.checkpoint.export import export_checkpoint

            formats = tuple(args.formats or ["safetensors"])
            written = export_checkpoint(args.src, args.out, args.tag, args.dtype, formats, args.max_shard_size)
            print(f"{args.out}: wrote {', '.join(written)}")
        elif args.action == "import-deepspeed":
            from raydeep.checkpoint.deepspeed_import import import_deepspeed

            tag = import_deepspeed(args.src, args.out, args.tag)
            print(f"{args.out}: imported DeepSpeed checkpoint {args.src} as tag {tag}")
        elif args.action == "reshard":
            tag = reshard(args.src, args.out, args.world_size, args.tag)
            print(f"{args.out}: wrote tag {tag} as {args.world_size} rank files")
        else:  # argparse only offers the actions above
            raise ValueError(f"unknown convert action {args.action!r}")
    except (RaydeepError, OSError, ValueError) as err:
        # pyarrow reports a bad URI as ValueError and a filesystem failure as OSError: user input.
        hint = ""
        if args.action != "import-deepspeed" and _looks_like_deepspeed(args.src):
            hint = f" ({args.src} is a DeepSpeed checkpoint: convert it with `raydeep convert import-deepspeed` first)"
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    return 0


def _looks_like_deepspeed(src: str) -> bool:
    """A local directory holding DeepSpeed's files, itself or in the tag its ``latest`` names."""
    try:
        from raydeep.checkpoint.deepspeed_files import locate

        locate(src)
        return True
    except Exception:  # noqa: BLE001 - only choosing whether to add a hint
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m raydeep.checkpoint.convert ACTION ...``: the same as ``raydeep convert``."""
    parser = argparse.ArgumentParser(prog="raydeep")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    return run_convert(parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
