"""``raydeep train``: run a TrainSpec with a progress bar and print the summary."""
from __future__ import annotations


def run_train_command(spec, address: str | None = None, verbose: bool = False) -> int:
    """Train, show progress, print the summary; 0 on success, 1 when the run failed after Ray
    Train's retries. A deterministic failure (a raydeep error: bad config, data or checkpoint)
    propagates, and the command line turns it into one message and exit status 2."""
    from rich.console import Console

    from raydeep.config.sections import RaydeepSection
    from raydeep.ray.progress import ProgressBar
    from raydeep.ray.trainer import connect, fit, plan_run

    plan = plan_run(spec)  # a config or input the run cannot use fails here, before Ray starts
    console = Console()
    _print_config_warnings(console, plan[0], spec.min_workers)
    joined = connect(spec, address, log_to_driver=verbose)
    if joined:
        console.print(f"joined the Ray cluster running at {joined} (pass --address local for a new one)")
    workers = spec.num_workers if isinstance(spec.num_workers, int) else f"{spec.min_workers}-{spec.max_workers}"
    console.print(f"raydeep train: {spec.model} on {spec.data} data, {workers} {'GPU' if spec.use_gpu else 'CPU'} "
                  f"workers, to step {spec.steps}, run {spec.run_uri}")
    try:
        with ProgressBar(spec.steps, console, print_console=not verbose) as bar:
            summary = fit(spec, on_progress=bar, address=address, log_to_driver=verbose, plan=plan)
    except Exception as exc:  # noqa: BLE001 - Ray Train's failure types vary; show the message, not a trace
        from raydeep.errors import RaydeepError

        if isinstance(exc, RaydeepError) or verbose:
            raise
        console.print(f"[red]training failed:[/red] {_first_lines(exc)}")
        console.print(f"re-run with --name {spec.name} --storage-path {spec.storage_path} to resume from the last "
                      "checkpoint; --verbose shows the workers' logs")
        return 1
    print_summary(console, summary)
    if RaydeepSection.model_validate(plan[0].get("raydeep") or {}).metrics:
        console.print(f"metrics: {spec.run_uri}/metrics/ (a row per step; raydeep.metrics.read_metrics reads them)")
    return 0


def _first_lines(exc: BaseException) -> str:
    """Each failed worker's error in one line (Ray Train's message carries whole tracebacks)."""
    failures = getattr(exc, "worker_failures", None)
    if not failures:
        return _last_line(exc) or type(exc).__name__
    return "; ".join(f"rank {rank}: {type(err).__name__}: {_last_line(err)}" for rank, err in sorted(failures.items()))


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else ""


def print_summary(console, summary: dict) -> None:
    restarts = f", {summary['restarts']} restart(s)" if summary["restarts"] else ""
    console.print(f"done: step {summary['global_steps']}, {summary['global_samples']} samples, final loss "
                  f"{summary['final_loss']:.4f}, {summary['samples_per_s']:.1f} samples/s, world sizes "
                  f"{summary['world_sizes']}{restarts}")
    for recovery in summary["recoveries"]:
        stall = f"{recovery['stall_s']:.1f} s" if recovery["stall_s"] is not None else "unknown"
        console.print(f"  restart to {recovery['world_size']} workers: resumed at step "
                      f"{recovery['resumed_from_step']} (last step before: {recovery['last_step_before']}), "
                      f"training stalled {stall}")
    console.print(f"param_sha256   {summary['param_sha256']}")
    console.print(f"samples_sha256 {summary['samples_sha256']}")
    console.print(f"summary: {summary['storage']}/summary.json")


def _print_config_warnings(console, ds_config: dict, world_size: int) -> None:
    """The keys the config loader warned about (no effect here, or a setting changed), as
    ``raydeep config check`` prints them: the workers log them too, but only with --verbose."""
    import logging

    from raydeep.config import load_config
    from raydeep.errors import ConfigError

    logger = logging.getLogger("raydeep")
    level = logger.level
    logger.setLevel(logging.ERROR)  # printed below, once
    try:
        cfg = load_config(ds_config, world_size=world_size)
    except ConfigError:
        return  # the batch plan resolves each world size's batch itself; the run reports what fails
    finally:
        logger.setLevel(level)
    for text in cfg.warnings:
        console.print(f"[yellow]warning:[/yellow] {text}", highlight=False, soft_wrap=True)
