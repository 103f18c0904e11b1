"""The ``raydeep`` command line.

    raydeep config check ds_config.json --world-size 8 --set train_micro_batch_size_per_gpu=4
    raydeep estimate --params 7.5e9 --world-size 64 --stage 3
    raydeep demo --steps 200

User mistakes exit with status 2 and a one-paragraph message naming the key, the value and the
fix; a Python traceback here is a raydeep bug.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from raydeep.errors import RaydeepError


def _config_check(args: argparse.Namespace) -> int:
    from raydeep.config import load_config

    cfg = load_config(args.file, world_size=args.world_size, overrides=args.set)
    for text in cfg.warnings:
        print(f"warning: {text}", file=sys.stderr)
    resolved = cfg.to_ds_dict()
    if args.json:
        print(json.dumps(resolved, indent=2, sort_keys=True))
    else:
        zero = cfg.zero_optimization
        print(f"{args.file}: valid for world size {cfg.world_size}")
        print(f"  batch: train_batch_size={cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu}"
              f" x accumulation {cfg.gradient_accumulation_steps} x world {cfg.world_size}")
        print(f"  zero stage {zero.stage}, precision {cfg.precision}, overlap_comm {zero.overlap_comm}, "
              f"gradient_clipping {cfg.gradient_clipping}")
        if cfg.optimizer:
            print(f"  optimizer {cfg.optimizer.type}, scheduler {cfg.scheduler.type if cfg.scheduler else 'none'}")
    return 0


def _parse_count(text: str) -> int:
    value = float(text)
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(value)


def _estimate(args: argparse.Namespace) -> int:
    from raydeep.estimate import estimate_model_states

    est = estimate_model_states(args.params, args.world_size, args.stage, precision=args.precision,
                                offload_optimizer=args.offload, include_buffers=args.buffers)
    if args.json:
        print(json.dumps(est.as_dict(), indent=2))
    else:
        print(f"per-rank model states: {args.params:,} params, world size {args.world_size}, "
              f"ZeRO stage {args.stage}, {args.precision}{', optimizer offload' if args.offload else ''}")
        print(est.format_table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from raydeep.demo import run_demo

    return run_demo(steps=args.steps, world_size=args.world_size, stage=args.stage, model=args.model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydeep", description="DeepSpeed's training runtime on Ray and PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="inspect ds_config files").add_subparsers(dest="action", required=True)
    check = config.add_parser("check", help="validate and resolve a ds_config for a world size")
    check.add_argument("file", help="ds_config.json (JSON or HJSON)")
    check.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    check.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                       help='override a dotted key, e.g. --set optimizer.params.lr=3e-4 (resolves "auto")')
    check.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    check.set_defaults(func=_config_check)

    est = sub.add_parser("estimate", help="per-rank model-state memory from the ZeRO formula")
    est.add_argument("--params", type=_parse_count, required=True, help="number of parameters, e.g. 7.5e9")
    est.add_argument("--world-size", type=int, required=True)
    est.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    est.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    est.add_argument("--offload", action="store_true", help="optimizer states and master weights on CPU")
    est.add_argument("--buffers", action="store_true", help="include communication bucket buffers")
    est.add_argument("--json", action="store_true")
    est.set_defaults(func=_estimate)

    demo = sub.add_parser("demo", help="train the built-in GPT with ZeRO on local CPU ranks")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    demo.add_argument("--model", default="gpt-tiny")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raydeep`` console script."""
    logging.getLogger("raydeep").addHandler(logging.NullHandler())  # commands print warnings themselves
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RaydeepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
