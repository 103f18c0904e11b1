"""``raydeep doctor``: will this config run, on this model and these machines, and what is wrong with it?

:func:`diagnose` validates the ds_config for the world size, estimates per-rank device memory
item by item (:mod:`raydeep.doctor.memory`) and host memory for offload, predicts the bytes
communicated per step (:mod:`raydeep.doctor.traffic`) and, given the network's bandwidth, how long
they take and whether ZeRO++ or 1-bit Adam would pay (:mod:`raydeep.doctor.network`), says whether it fits and, if not, the
cheapest changes that make it fit (:mod:`raydeep.doctor.fit`), and runs the lint rules
(:mod:`raydeep.doctor.lint`). A config that cannot be loaded is itself a finding; when only the
batch size is missing (DeepSpeed's "Either train_batch_size or train_micro_batch_size_per_gpu
needs to be provided"), the estimate goes on with a micro batch of 1 and says so.

>>> from raydeep.doctor.shape import Cluster, ModelShape
>>> report = diagnose({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}},
...                   ModelShape.from_gpt("gpt-tiny"), Cluster(world_size=2, device_memory=10**9))
>>> report.memory.fits, report.exit_code
(True, 0)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from raydeep.config import load_config, read_config
from raydeep.config.loading import apply_overrides
from raydeep.config.model import BATCH_KEYS
from raydeep.doctor.fit import Change, changes_that_fit
from raydeep.doctor.memory import CHECKPOINTING, MemoryPlan, plan_memory
from raydeep.doctor.network import CodecRates, Links, NetworkPlan, plan_network
from raydeep.doctor.offload import OffloadRates, OffloadTime, predict_offload
from raydeep.doctor.shape import Cluster, Finding, ModelShape
from raydeep.doctor.traffic import Traffic, predict_traffic
from raydeep.errors import ConfigError, ConfigErrors
from raydeep.estimate import GB

__all__ = ["Cluster", "DoctorReport", "Finding", "ModelShape", "diagnose"]


@dataclass
class DoctorReport:
    source: str
    shape: ModelShape
    cluster: Cluster
    findings: list[Finding] = field(default_factory=list)
    config: object | None = None  # the loaded RaydeepConfig, when it loads
    memory: MemoryPlan | None = None
    traffic: Traffic | None = None
    offload: OffloadTime | None = None
    network: NetworkPlan | None = None
    fixes: list[Change] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """2: errors (an invalid config, or it does not fit); 1: warnings only; 0: clean."""
        severities = {f.severity for f in self.findings}
        return 2 if "error" in severities else 1 if "warning" in severities else 0

    def as_dict(self) -> dict:
        return {"config": self.source, "model": {k: v for k, v in vars(self.shape).items() if k != "tensors"},
                "cluster": {**vars(self.cluster), "nodes": self.cluster.nodes}, "assumed": self.assumed,
                "memory": self.memory.as_dict() if self.memory else None,
                "traffic": {"by_op": self.traffic.by_op, "ring_bytes": self.traffic.ring_bytes,
                            "cross_node_bytes": self.traffic.cross_node_bytes,
                            "intra_node_bytes": self.traffic.intra_node_bytes} if self.traffic else None,
                "network": self.network.as_dict() if self.network else None,
                "offload": ({**vars(self.offload), "hidden_by_delay": self.offload.hidden_by_delay}
                            if self.offload else None),
                "fixes": [c.as_dict() for c in self.fixes], "findings": [f.as_dict() for f in self.findings],
                "exit_code": self.exit_code}


def diagnose(config, shape: ModelShape, cluster: Cluster, overrides=None, on_device: bool = True,
             offload_rates: OffloadRates | None = None, links: Links | None = None,
             codec_rates: CodecRates | None = None) -> DoctorReport:
    """Everything ``raydeep doctor`` prints, as data (see the module docstring). With
    ``offload_rates``, also what optimizer offload adds to the step (:mod:`raydeep.doctor.offload`);
    with ``links`` and ``codec_rates``, the step's communication time and the ZeRO++ / 1-bit
    verdict (:mod:`raydeep.doctor.network`)."""
    source = config if isinstance(config, str) else "<dict>"
    report = DoctorReport(source, shape, cluster)
    try:
        raw = apply_overrides(read_config(config), overrides)
    except ConfigError as err:
        report.findings += _config_findings(err)
        return report
    cfg, raw = _load(raw, cluster.world_size, report)
    if cfg is None:
        return report
    report.config = cfg
    report.memory = plan_memory(cfg, shape, cluster.device_memory, cluster.host_memory, cluster.gpus_per_node,
                                on_device=on_device)
    report.traffic = predict_traffic(cfg, shape, cluster.gpus_per_node)
    if links is not None and codec_rates is not None:
        report.network = plan_network(cfg, shape, cluster, links, codec_rates)
    if offload_rates is not None:
        report.offload = predict_offload(cfg, shape, cluster.world_size, offload_rates)
    if report.memory.fits is False:
        report.fixes = changes_that_fit(raw, cfg, shape, cluster)
        report.findings.append(_does_not_fit(report.memory, report.fixes))
    from raydeep.doctor.lint import lint

    report.findings += lint(cfg, shape, cluster)
    return report


def _load(raw: dict, world_size: int, report: DoctorReport):
    try:
        return load_config(copy.deepcopy(raw), world_size=world_size), raw
    except ConfigError as err:
        report.findings += _config_findings(err)
        if not _only_batch_errors(err):
            return None, raw
    # The batch triangle does not hold for this world size: estimate per rank with the micro batch
    # and accumulation the config gives, deriving the global batch (what the fix proposes).
    raw = {k: v for k, v in raw.items() if k != "train_batch_size"}
    if "train_micro_batch_size_per_gpu" not in raw:
        raw["train_micro_batch_size_per_gpu"] = 1
    report.assumed.append(f"train_micro_batch_size_per_gpu = {raw['train_micro_batch_size_per_gpu']}, "
                          f"gradient_accumulation_steps = {raw.get('gradient_accumulation_steps', 1)}, "
                          "train_batch_size derived for this world size")
    try:
        return load_config(copy.deepcopy(raw), world_size=world_size), raw
    except ConfigError as err:
        report.findings += _config_findings(err)
        return None, raw


def _only_batch_errors(err: ConfigError) -> bool:
    errors = err.errors if isinstance(err, ConfigErrors) else [err]
    return all(e.key in BATCH_KEYS for e in errors)


def _config_findings(err: ConfigError) -> list[Finding]:
    errors = err.errors if isinstance(err, ConfigErrors) else [err]
    findings = []
    for e in errors:
        shown = f"{e.key} = {e.value!r}: " if e._value_given else f"{e.key}: "
        findings.append(Finding("invalid-config", "error", shown + e.message, "raydeep (and DeepSpeed) refuse this "
                                "config at load", e.fix or "see the message", key=e.key))
    return findings


def _does_not_fit(plan: MemoryPlan, fixes: list[Change]) -> Finding:
    parts = []
    if plan.device_memory is not None and plan.device_total > plan.device_memory:
        parts.append(f"needs {plan.device_total / GB:.1f} GB of device memory per rank, "
                     f"{plan.device_memory / GB:.1f} GB available")
    if plan.host_memory is not None and plan.host_total > plan.host_memory:
        parts.append(f"needs {plan.host_total / GB:.1f} GB of host memory per node, {plan.host_memory / GB:.1f} GB available")
    fix = f"cheapest change: {fixes[0].title} ({fixes[0].cost_text})" if fixes else \
        "no change tried fits: use more ranks or a smaller micro batch/sequence"
    return Finding("does-not-fit", "error", "the run does not fit: " + "; ".join(parts),
                   "the first step would end in an out-of-memory error", fix)


def format_report(report: DoctorReport) -> str:
    """The text ``raydeep doctor`` prints."""
    s, c = report.shape, report.cluster
    lines = [f"raydeep doctor: {report.source}",
             f"  model {s.name}: {s.params:,} parameters, {s.layers} layers, hidden {s.hidden}, seq {s.seq}, "
             f"vocab {s.vocab}, largest block {s.block_params:,}",
             f"  cluster: {c.world_size} ranks ({c.nodes} node(s) x {c.gpus_per_node})"
             + (f", {c.device_memory / GB:.0f} GB per device" if c.device_memory else "")
             + (f", {c.host_memory / GB:.0f} GB host per node" if c.host_memory else "")]
    cfg = report.config
    if cfg is not None:
        zero = cfg.zero_optimization
        lines.append(f"  config: ZeRO stage {zero.stage}, {cfg.precision}, train_batch_size {cfg.train_batch_size} = "
                     f"micro {cfg.train_micro_batch_size_per_gpu} x accumulation {cfg.gradient_accumulation_steps} "
                     f"x world {cfg.world_size}")
    lines += [f"  assumed: {text}" for text in report.assumed]
    if report.memory is not None:
        m = report.memory
        lines += ["", m.format_table(), "",
                  "activations by checkpointing choice (per rank): " + ", ".join(
                      f"{c} {m.activations[c] / GB:.2f} GB{' (this config)' if c == m.checkpointing else ''}"
                      for c in CHECKPOINTING)]
    if report.traffic is not None:
        t = report.traffic
        ops = ", ".join(f"{op} {b / GB:.3f} GB" for op, b in t.by_op.items()) or "none (one rank)"
        lines.append(f"communication per step and rank: {ops}; sent over a ring: {t.ring_bytes / GB:.3f} GB"
                     + (f" ({t.cross_node_bytes / GB:.3f} GB of it the rank's share across nodes)" if c.nodes > 1 else ""))
    if report.network is not None:
        lines.append(report.network.describe())
    if report.offload is not None:
        lines.append(report.offload.describe())
    if report.memory is not None and report.memory.fits is not None:
        lines.append(f"verdict: {'fits' if report.memory.fits else 'DOES NOT FIT'}")
    if report.fixes:
        lines.append("changes that make it fit, cheapest first:")
        for i, change in enumerate(report.fixes, 1):
            sets = " ".join(f"--set {k}={_json(v)}" for k, v in change.settings.items())
            lines.append(f"  {i}. {change.title}: {change.plan.device_total / GB:.1f} GB per rank; cost: {change.cost_text}")
            lines.append(f"     {sets}")
    lines.append("")
    if report.findings:
        lines.append(f"findings ({len(report.findings)}):")
        for f in report.findings:
            lines.append(f"  {f.severity} [{f.rule}] {f.message}")
            lines.append(f"      why: {f.reason}")
            lines.append(f"      fix: {f.fix}")
    else:
        lines.append("findings: none")
    return "\n".join(lines)


def _json(value) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))
