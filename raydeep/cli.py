"""The ``raydeep`` command line.

    raydeep config check ds_config.json --world-size 8 --set train_micro_batch_size_per_gpu=4
    raydeep estimate --params 7.5e9 --world-size 64 --stage 3
    raydeep doctor ds_config.json --model gpt2-medium --world-size 8 --gpu-memory 80GB
    raydeep demo --steps 200
    raydeep train --num-workers 2 --steps 200 --name tiny   # Ray Train; re-run to resume

User mistakes exit with status 2 and a one-paragraph message naming the key, the value and the
fix; a Python traceback here is a raydeep bug.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from raydeep.autotune import add_parser as add_autotune_parser
from raydeep.bench import add_parser as add_bench_parser
from raydeep.checkpoint.convert import add_convert_parser
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


def _parse_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number, e.g. 3e11")
    return value


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


def _doctor(args: argparse.Namespace) -> int:
    from raydeep.doctor import Cluster, diagnose, format_report
    from raydeep.doctor.shape import parse_bytes

    shape = _doctor_shape(args)
    world = args.world_size or (args.nodes or 1) * (args.gpus_per_node or 1)
    gpus_per_node = args.gpus_per_node or min(world, 8 if args.gpu_memory else world)
    cluster = Cluster(world_size=world, gpus_per_node=gpus_per_node,
                      device_memory=parse_bytes(args.gpu_memory) if args.gpu_memory else None,
                      host_memory=parse_bytes(args.cpu_memory) if args.cpu_memory else None)
    links, codec_rates = _network_rates(args, gpus_per_node)
    report = diagnose(args.config, shape, cluster, overrides=args.set, on_device=not args.cpu,
                      offload_rates=_offload_rates(args), links=links, codec_rates=codec_rates)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return report.exit_code


def _network_rates(args: argparse.Namespace, gpus_per_node: int):
    """The links and (de)quantization rates of the communication-time model: nothing without
    ``--bandwidth``; the codecs measured on this machine unless ``--quantize-rate`` gives them."""
    from raydeep.errors import InputError

    if args.bandwidth is None:
        for flag, value in (("--intra-node-bandwidth", args.intra_node_bandwidth), ("--quantize-rate", args.quantize_rate),
                            ("--latency", args.latency), ("--intra-node-latency", args.intra_node_latency)):
            if value is not None:
                raise InputError(flag, "only the communication-time model reads it, and it runs with --bandwidth",
                                 value=value, fix="add --bandwidth, e.g. --bandwidth 25Gbps")
        return None, None
    from raydeep.doctor.network import (DEFAULT_INTRA_NODE, DEFAULT_INTRA_NODE_LATENCY, DEFAULT_LATENCY, CodecRates,
                                        Links, bandwidth_per_rank, measure_codec_rates, parse_latency)

    speeds = []
    for flag, text in (("--bandwidth", args.bandwidth), ("--intra-node-bandwidth", args.intra_node_bandwidth or DEFAULT_INTRA_NODE)):
        try:
            speeds.append(bandwidth_per_rank(text, gpus_per_node))
        except ValueError:
            raise InputError(flag, "is not a bandwidth", value=text,
                             fix="write bits per second as 25Gbps (or 25Gb/s) or bytes per second as 600GB (or "
                                 "600GB/s); add /node for a node's links shared by its GPUs, e.g. 100Gbps/node") from None
    latencies = []
    for flag, text, default in (("--latency", args.latency, DEFAULT_LATENCY),
                                ("--intra-node-latency", args.intra_node_latency, DEFAULT_INTRA_NODE_LATENCY)):
        try:
            latencies.append(parse_latency(text or default))
        except ValueError:
            raise InputError(flag, "is not a latency", value=text,
                             fix="write the seconds a small collective takes, e.g. 50us, 0.2ms or 1e-5") from None
    rates = CodecRates.given(args.quantize_rate) if args.quantize_rate else measure_codec_rates()
    return Links(*speeds, *latencies), rates


def _offload_rates(args: argparse.Namespace):
    """The rates the offload prediction uses: given, or this machine's CPU update measured."""
    from raydeep.doctor.offload import OffloadRates, measured_cpu_rate
    from raydeep.doctor.shape import parse_bytes

    rate = args.cpu_update_rate or measured_cpu_rate()
    return OffloadRates(rate, args.cpu_threads, parse_bytes(args.offload_bandwidth), args.device_tflops)


def _doctor_shape(args: argparse.Namespace):
    from raydeep.doctor.shape import ModelShape
    from raydeep.errors import InputError

    counts = [args.params, args.layers, args.hidden, args.seq, args.vocab]
    if args.model and any(v is not None for v in counts[:3]):
        raise InputError("--model", "give the model either by name or by its sizes, not both", value=args.model,
                         fix="drop --model, or drop --params/--layers/--hidden")
    if args.model:
        from raydeep.models.gpt import GPT_SIZES

        if args.model in GPT_SIZES:
            return ModelShape.from_gpt(args.model, seq=args.seq)
        if ":" not in args.model:
            raise InputError("--model", "is neither a built-in GPT size nor package.module:function", value=args.model,
                             fix=f"use one of {', '.join(GPT_SIZES)} or pkg.module:fn")
        import torch

        from raydeep.ray.workload import build_model, sequence_shape

        with torch.device("meta"):
            model = build_model(args.model, 0)
        return ModelShape.from_module(model, args.seq or sequence_shape(model)[0], name=args.model)
    missing = [flag for flag, v in zip(("--params", "--layers", "--hidden", "--seq", "--vocab"), counts) if v is None]
    if missing:
        raise InputError("--model", "the doctor needs the model", fix=f"pass --model NAME, or {' '.join(missing)}")
    return ModelShape.from_counts(*counts)


def _demo(args: argparse.Namespace) -> int:
    from raydeep.demo import run_demo

    return run_demo(steps=args.steps, world_size=args.world_size, stage=args.stage, model=args.model)


def _parse_resources(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise argparse.ArgumentTypeError('expected an object of resource amounts, e.g. {"trainer": 1}')
    return value


def train_spec(args: argparse.Namespace):
    """The :class:`~raydeep.ray.TrainSpec` of parsed ``raydeep train`` arguments."""
    from raydeep.ray import TrainSpec, parse_num_workers
    from raydeep.ray.spec import DEFAULT_DS_CONFIG, default_run_name

    return TrainSpec(ds_config=args.config or DEFAULT_DS_CONFIG, model=args.model, data=args.data,
                     num_workers=parse_num_workers(args.num_workers), use_gpu=args.use_gpu,
                     cpus_per_worker=args.cpus_per_worker, steps=args.steps, checkpoint_every=args.checkpoint_every,
                     storage_path=args.storage_path, name=args.name or default_run_name(),
                     max_failures=args.max_failures, seed=args.seed, export_fp32=args.export_fp32,
                     overrides=args.set, resources_per_worker=args.worker_resources)


def _train(args: argparse.Namespace) -> int:
    from raydeep.ray.train_command import run_train_command

    spec = train_spec(args)
    if not args.verbose:
        logging.getLogger("ray").setLevel(logging.WARNING)  # the progress bar says what Ray is doing
    return run_train_command(spec, address=args.address, verbose=args.verbose)


def _data_build(args: argparse.Namespace) -> int:
    from raydeep.data import build_byte_dataset

    count = build_byte_dataset(args.out, args.files or None, block_size=args.block_size, max_bytes=args.max_bytes)
    source = ", ".join(args.files) if args.files else "the embedded corpus"
    print(f"{args.out}: {count} samples of {args.block_size + 1} byte tokens from {source}")
    return 0


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

    _add_doctor_parser(sub)

    demo = sub.add_parser("demo", help="train the built-in GPT with ZeRO on a local Ray cluster of CPU workers")
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    demo.add_argument("--model", default="gpt-tiny")
    demo.set_defaults(func=_demo)

    _add_train_parser(sub)
    add_convert_parser(sub)
    _add_data_parser(sub)
    _add_report_parser(sub)
    add_bench_parser(sub)
    add_autotune_parser(sub)
    return parser


def _add_doctor_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="will this config fit and run? memory per rank, communication, lint",
                            description="Validate a ds_config for a model and a cluster: itemised per-rank memory "
                            "(model states, buckets, stage-3 live parameters, activations by checkpointing choice, "
                            "fragmentation margin), host memory for offload, bytes per step, whether it fits and the "
                            "cheapest changes that make it fit, and lint rules. Exit status: 0 clean, 1 warnings, "
                            "2 errors.")
    doctor.add_argument("config", help="ds_config.json (JSON or HJSON)")
    doctor.add_argument("--model", help="built-in GPT size (gpt-tiny, gpt2-medium, gpt-1.3b, ...) or pkg.module:fn")
    doctor.add_argument("--params", type=_parse_count, help="parameters, e.g. 175e9 (with --layers --hidden --seq --vocab)")
    doctor.add_argument("--layers", type=_parse_count)
    doctor.add_argument("--hidden", type=_parse_count)
    doctor.add_argument("--seq", type=_parse_count, help="sequence length (default: the model's block size)")
    doctor.add_argument("--vocab", type=_parse_count)
    doctor.add_argument("--world-size", type=_parse_count, help="data-parallel ranks (or --nodes x --gpus-per-node)")
    doctor.add_argument("--nodes", type=_parse_count)
    doctor.add_argument("--gpus-per-node", type=_parse_count)
    doctor.add_argument("--gpu-memory", metavar="SIZE", help="device memory per rank, e.g. 80GB")
    doctor.add_argument("--cpu-memory", metavar="SIZE", help="host memory per node, e.g. 1TB")
    doctor.add_argument("--cpu", action="store_true", help="CPU ranks: no caching-allocator margin")
    doctor.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a ds_config key")
    doctor.add_argument("--json", action="store_true", help="the report as JSON")
    offload = doctor.add_argument_group("optimizer offload (what it adds to a step)")
    offload.add_argument("--cpu-update-rate", type=_parse_count, metavar="ELEMS_PER_S",
                         help="the CPU update's elements/s per thread (default: measured on this machine)")
    offload.add_argument("--cpu-threads", type=int, default=8, help="threads each rank's CPU update gets (8)")
    offload.add_argument("--offload-bandwidth", default="25GB", metavar="BYTES_PER_S",
                         help="per second, each way, rank to masters: pinned PCIe 4.0 x16 is about 25GB (default); "
                              "the network's for offload actors")
    offload.add_argument("--device-tflops", type=float, help="the device's dense peak, to estimate forward and "
                         "backward (e.g. 989 for an H100's bf16)")
    network = doctor.add_argument_group("communication time (with --bandwidth): plain ZeRO-3 against ZeRO++, the "
                                        "all-reduce against 1-bit Adam / 0/1 Adam, and which to use")
    network.add_argument("--bandwidth", metavar="RATE", help="network bandwidth between nodes per rank, each way: "
                         "25Gbps (bits) or 3GB (bytes per second); 100Gbps/node for a node's NICs shared by its GPUs")
    network.add_argument("--intra-node-bandwidth", metavar="RATE", help="per rank inside a node, each way (default "
                         "300GB: NVLink 3; an H100's NVLink 4 is 450GB)")
    network.add_argument("--latency", metavar="SECONDS", help="what each collective across nodes costs whatever its "
                         "size, e.g. 50us (default: a small NCCL collective between nodes); nccl-tests' smallest sizes "
                         "measure it")
    network.add_argument("--intra-node-latency", metavar="SECONDS", help="the same for a collective inside a node "
                         "(hpZ's gathers, qgZ's first phase; default 10us)")
    network.add_argument("--quantize-rate", type=_parse_positive, metavar="ELEMS_PER_S",
                         help="elements per second of one quantize or dequantize pass on the training device (qwZ, "
                              "qgZ, 1-bit); default: measured on this machine (its GPU, else its CPU: far slower)")
    doctor.set_defaults(func=_doctor)


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train with ZeRO on a Ray cluster (a local one when none is given)",
                           description="Train to global step --steps; re-running the same --storage-path and "
                           "--name continues the run from its last checkpoint, at any --num-workers.")
    train.add_argument("--config", help="ds_config.json (default: the tiny GPT with ZeRO-3, global batch 16)")
    train.add_argument("--model", default="gpt-tiny", help="GPT size (gpt-tiny, gpt-small-cpu, ...) or "
                       "package.module:function returning the model")
    train.add_argument("--data", default="builtin", help="builtin (embedded corpus), synthetic, or a Parquet "
                       "token dataset path/URI (see `raydeep data build`)")
    train.add_argument("--num-workers", default="2", metavar="N|MIN:MAX", help="fixed, or an elastic range")
    train.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL)")
    train.add_argument("--cpus-per-worker", type=float, default=1.0)
    train.add_argument("--worker-resources", type=_parse_resources, default={}, metavar="JSON",
                       help='extra Ray resources each worker needs, e.g. \'{"trainer": 1}\' (keeps workers off '
                            "nodes without it, such as CPU offload nodes)")
    train.add_argument("--steps", type=int, default=200, help="the global step to train to")
    train.add_argument("--checkpoint-every", type=int, default=50, metavar="K")
    train.add_argument("--storage-path", default="runs", help="shared storage for checkpoints and "
                       "summary.json: a path every node can reach, or s3://..., gs://...")
    train.add_argument("--name", help="run name (default: raydeep-<date>-<time>); reuse it to resume")
    train.add_argument("--max-failures", type=int, default=3, help="worker-group restarts allowed (-1: no limit)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a ds_config key")
    train.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else the cluster `ray start` "
                       "left running on this machine, as ray.init() does, else a new local one; 'local' always "
                       "starts a new one)")
    train.add_argument("--export-fp32", action="store_true", help="write the consolidated fp32 weights "
                       "(safetensors) beside summary.json")
    train.add_argument("--verbose", action="store_true", help="show Ray's and the workers' logs")
    train.set_defaults(func=_train)


def _add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="token datasets").add_subparsers(dest="action", required=True)
    build = data.add_parser("build", help="tokenise text files to bytes into a Parquet token dataset")
    build.add_argument("out", help="output .parquet path or URI")
    build.add_argument("files", nargs="*", help="text files (default: the embedded corpus)")
    build.add_argument("--block-size", type=int, default=128)
    build.add_argument("--max-bytes", type=int, default=None)
    build.set_defaults(func=_data_build)


def _report(args: argparse.Namespace) -> int:
    from raydeep.report import build_report

    written = build_report(args.run, args.out)
    print(f"wrote {written[-1]} and its {len(written) - 1} plots")
    return 0


def _add_report_parser(sub) -> None:
    report = sub.add_parser("report", help="plots and a markdown report of a run directory (finished or not)",
                            description="Plot a run's per-step metrics (loss, throughput, step-time breakdown, "
                            "memory per rank, collective traffic) against the step, restarts and world sizes "
                            "marked, and write report.md with the run's summary table and the plots.")
    report.add_argument("run", metavar="RUN", help="the run directory <storage>/<name>: a path or a URI (s3://...)")
    report.add_argument("--out", metavar="DIR", help="where to write the report (default: RUN/report)")
    report.set_defaults(func=_report)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raydeep`` console script."""
    logging.getLogger("raydeep").addHandler(logging.NullHandler())  # commands print warnings themselves
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RaydeepError as exc:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
