"""``raydeep bench``: raydeep's ZeRO stages against DDP, torch's ZeRO-1, FSDP2 and DeepSpeed on the
built-in GPT, interleaved in one invocation (see :mod:`raydeep.bench.run`)."""
from __future__ import annotations

import argparse
import json
import os


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="step time of raydeep's stages against DDP, ZeRO-1, FSDP2 and DeepSpeed",
                           description="Step time of raydeep's ZeRO stages against DDP, torch's ZeRO-1, FSDP2 and "
                           "DeepSpeed on the built-in GPT, interleaved in one invocation. Writes JSON, a markdown "
                           "table and a PNG chart.")
    bench.add_argument("--model", default="gpt-tiny", help="a size from raydeep.models.GPT_SIZES")
    bench.add_argument("--n-layer", type=int, default=0, help="override the size's layer count (0: keep it)")
    bench.add_argument("--world", type=int, default=2, help="gloo ranks (processes here, or Ray actors with --ray)")
    bench.add_argument("--ray", action="store_true", help="run the ranks as Ray actors on a Ray cluster (one "
                       "--threads CPUs each, packed in a placement group) instead of local processes")
    bench.add_argument("--address", help="the Ray cluster for --ray (default: RAY_ADDRESS, a cluster running here, "
                       "or a new local one)")
    bench.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: raydeep and DeepSpeed with "
                       "bf16.enabled, DDP and ZeRO-1 under bf16 autocast, FSDP2 with bf16 parameters and reduction")
    bench.add_argument("--steps", type=int, default=6, help="interleaved rounds measured (one step of each)")
    bench.add_argument("--warmup", type=int, default=2, help="rounds dropped before measuring")
    bench.add_argument("--seq", type=int, default=128)
    bench.add_argument("--micro-batch", type=int, default=4, help="per rank")
    bench.add_argument("--gas", type=int, default=2, help="gradient accumulation steps")
    bench.add_argument("--lr", type=float, default=1e-4, help="every contender's AdamW learning rate")
    bench.add_argument("--bucket", type=int, default=500_000, help="reduce/all-gather bucket in elements (and DDP's)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    bench.add_argument("--overlap", choices=("default", "on", "off", "both"), default="default",
                       help="raydeep's overlap_comm at stages 1-3: default is DeepSpeed's (off at 1-2, on at 3), "
                       "as DeepSpeed's rows run; both: a row each, and the blocked time hidden")
    bench.add_argument("--zeropp", type=int, default=0, metavar="RANKS_PER_NODE",
                       help="add ZeRO++ rows at stage 3 (hpZ, qwZ, qgZ and all three), the ranks declared as nodes "
                       "of this many (LOCAL_WORLD_SIZE); 0: none")
    bench.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="leave DeepSpeed out")
    bench.add_argument("--out", default="bench", help="directory for bench.json, bench.md and bench.png")
    bench.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the ranks")
    bench.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from raydeep.bench.render import chart, markdown
    from raydeep.bench.run import run
    from raydeep.errors import InputError

    if args.zeropp and (args.zeropp < 1 or args.world % args.zeropp):
        raise InputError("--zeropp", f"must divide --world {args.world}", value=args.zeropp,
                         fix="pass the ranks per node, e.g. --world 4 --zeropp 2")
    if args.steps < 1 or args.warmup < 0 or args.world < 1:
        raise InputError("--steps/--warmup/--world", "must be >= 1, >= 0 and >= 1",
                         value=(args.steps, args.warmup, args.world), fix="pass positive counts")
    args.overlap = {"default": (None,), "on": (True,), "off": (False,), "both": (False, True)}[args.overlap]
    summary = run(args)
    table = markdown(summary)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(table + "\n")
    chart(summary, os.path.join(args.out, "bench.png"))
    print(f"wrote {args.out}/bench.json, bench.md and bench.png")
    return 0
