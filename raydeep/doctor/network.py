"""How long a step's communication takes on a given network, and whether ZeRO++ or 1-bit Adam pays.

The field report's rule of thumb is a bandwidth: compression is worth its compute only on one side
of about 25 Gbps between nodes. This module makes that rule a calculation for a config, a model and
a cluster. For each way of communicating the step (plain ZeRO-3 and ZeRO-3 with each ZeRO++ part
and all three; at stage 0/1 the plain all-reduce and 1-bit Adam / 0/1 Adam after their warm-up) it
takes the bytes :func:`raydeep.doctor.traffic.predict_traffic` says each rank sends, split into what
crosses between nodes and what stays inside a node, and adds up

    collectives launched x latency
    + cross-node bytes / network bandwidth + intra-node bytes / intra-node bandwidth
    + elements (de)quantized / the (de)quantization rate

per optimizer step (summed: a conservative bound, as if nothing overlapped). A model of many small
units is latency-bound: each collective costs its launch and the slowest peer's arrival whatever it
carries. The rates are given (``--bandwidth``, ``--intra-node-bandwidth``, ``--latency``,
``--quantize-rate``) or, for the (de)quantization,
measured on this machine with the engine's own quantizers (``raydeep.zero.quantize``; the 1-bit
codec of ``raydeep.compression``): on its GPU when it has one, else on its CPU, which is far slower
than a GPU, so on a login node pass the training device's rate.

An option's break-even bandwidth is where its saved network time equals the compute it adds: it
pays below that bandwidth and costs above it.

>>> parse_bandwidth("25Gbps"), parse_bandwidth("600GB"), parse_bandwidth("100 Gb/s")
(3125000000.0, 600000000000.0, 12500000000.0)
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field

from raydeep.doctor.shape import Cluster, ModelShape
from raydeep.doctor.traffic import Traffic, predict_compressed_traffic, predict_traffic
from raydeep.estimate import GB, PRECISION_BYTES

DEFAULT_INTRA_NODE = "300GB"  # per direction per GPU: NVLink 3 (A100); an H100's NVLink 4 is 450GB
DEFAULT_LATENCY = "50us"  # a small-message NCCL collective between nodes: tens of microseconds
DEFAULT_INTRA_NODE_LATENCY = "10us"  # the same inside a node, over NVLink
CODECS = ("int8", "int4", "1bit")
WORTH_IT = 0.05  # an option must save 5% of the plain communication time to be recommended

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(bps|bit/s|bits/s|b/s|Bps|B/s|B)"
                        r"\s*(/\s*(?:node|gpu|rank))?\s*")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``25Gbps`` / ``25Gb/s`` / ``25Gbit/s`` (bits) or ``600GB`` /
    ``600GB/s`` / ``600GBps`` (bytes); decimal prefixes (k, M, G, T). Bits and bytes differ by
    the case of the ``b``, so a lowercase ``gb`` is refused rather than guessed. A ``/node``
    suffix is kept for :func:`bandwidth_per_rank`."""
    parsed = _parse(text)
    if parsed is None:
        raise ValueError(f"{text!r} is not a bandwidth; write bits per second as 25Gbps (or 25Gb/s) or bytes "
                         "per second as 3GB (or 3GB/s); add /node for a node's links shared by its GPUs")
    return parsed[0]


def bandwidth_per_rank(text: str, gpus_per_node: int) -> float:
    """A rank's share: ``text`` as given, or divided by the GPUs of a node when it ends in ``/node``.

    >>> bandwidth_per_rank("100Gbps/node", 8), bandwidth_per_rank("100Gbps", 8)
    (1562500000.0, 12500000000.0)
    """
    value = parse_bandwidth(text)
    return value / gpus_per_node if _parse(text)[1] else value


def _parse(text: str) -> tuple[float, bool] | None:
    match = _BANDWIDTH.fullmatch(str(text))
    if not match:
        return None
    number, prefix, unit, per = match.groups()
    value = float(number) * _PREFIX[prefix.lower()] / (8 if unit[0] == "b" else 1)
    if not value > 0 or math.isinf(value):
        return None
    return value, bool(per and "node" in per)


_LATENCY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*")
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


def parse_latency(text: str) -> float:
    """Seconds from ``50us`` / ``0.2ms`` / ``1e-5`` (seconds without a unit); zero is allowed.

    >>> parse_latency("50us"), parse_latency("0.2 ms"), parse_latency("0")
    (5e-05, 0.0002, 0.0)
    """
    match = _LATENCY.fullmatch(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a latency; write it as 50us, 0.2ms or 1e-5 (seconds)")
    return float(match.group(1)) / _PER_SECOND[match.group(2) or "s"]


def format_bandwidth(bytes_s: float) -> str:
    """``3.125e9`` -> ``25 Gbps`` (networks are sold in bits)."""
    gbps = bytes_s * 8 / 1e9
    return f"{gbps:.3g} Gbps" if gbps < 1000 else f"{gbps / 1000:.3g} Tbps"


# --- (de)quantization rates ------------------------------------------------------------------


@dataclass(frozen=True)
class CodecRates:
    """Seconds per element of one quantize or dequantize pass, by codec (qwZ's ``int8``, qgZ's
    ``int4``, 1-bit Adam's ``1bit``), and where the numbers come from."""

    seconds_per_element: dict[str, float]
    source: str

    @staticmethod
    def given(elements_per_s: float) -> "CodecRates":
        return CodecRates({c: 1 / elements_per_s for c in CODECS}, f"given: {elements_per_s:.3g} elements/s per pass")

    def seconds(self, passes: dict[str, int]) -> float:
        return sum(n * self.seconds_per_element[c] for c, n in passes.items())


def measure_codec_rates(numel: int = 1 << 20, reps: int = 3) -> CodecRates:
    """Time the engine's quantizers over ``numel`` elements (4 MB of fp32; a median of ``reps``
    after a warm-up): on this machine's GPU if it has one, else on its CPU."""
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    x = torch.randn(numel, device=device).to(torch.float16)
    rates = {kind: _timed(fn, device, reps) / (2 * numel) for kind, fn in _codecs(x).items()}
    where = torch.cuda.get_device_name() if device.type == "cuda" else \
        f"this machine's CPU ({torch.get_num_threads()} threads; a GPU is far faster: pass --quantize-rate)"
    return CodecRates(rates, f"measured on {where}: " + ", ".join(f"{k} {1 / v:.3g}" for k, v in rates.items())
                      + " elements/s per pass")


def _codecs(x) -> dict:
    """One quantize + dequantize round trip of ``x`` per codec (two passes over it)."""
    from raydeep.compression.bits import pack_signs, unpack_signs

    def onebit():  # 1-bit Adam's worker side: error feedback, scale, signs packed; decoded back
        error = x.float()
        scale = error.norm() / math.sqrt(error.numel())
        packed = pack_signs(error)
        decoded = unpack_signs(packed, error.numel()) * scale
        error.sub_(decoded)

    try:
        from raydeep.zero import quantize
    except ImportError:  # the engine's quantizers are not there: the same arithmetic in brief
        return {"int8": lambda: _round_trip(x, 8, 8000), "int4": lambda: _round_trip(x, 4, 2048), "1bit": onebit}

    groups = x.numel() // 2048

    def int8():
        values, scales = quantize.quantize_weights(x)
        quantize.dequantize_weights(values, scales, x.dtype)

    def int4():
        packed, scales = quantize.swizzle_quant(x, groups, 1, 1)
        quantize.dequantize_int4(packed, scales, groups, x.dtype)

    return {"int8": int8, "int4": int4, "1bit": onebit}


def _round_trip(x, bits: int, group: int) -> None:
    import torch

    rows = x.float().view(-1, group)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / (2 ** (bits - 1) - 1)
    q = torch.round(rows / scale).to(torch.int8)
    (q.float() * scale).to(x.dtype)


def _timed(fn, device, reps: int) -> float:
    import torch

    took = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took.append(time.perf_counter() - began)
    return statistics.median(took[1:])


# --- the options and the verdict ---------------------------------------------------------------


@dataclass(frozen=True)
class Links:
    """Bytes per second a rank sends: to other nodes (its NIC, or its share of the node's) and to
    ranks of its own node; and the seconds each collective costs whatever its size."""

    network: float
    intra_node: float
    latency: float = 0.0  # a collective over ranks on several nodes
    intra_node_latency: float | None = None  # one over the ranks of one node (None: ``latency``)


@dataclass(frozen=True)
class Option:
    """One way to communicate the step, and what it costs per optimizer step on each rank."""

    name: str
    settings: dict  # the ds_config keys that select it, as --set takes them
    traffic: Traffic
    network_s: float  # its cross-node bytes over the network
    intra_node_s: float  # its intra-node bytes over the node's links
    links_s: float  # per op, the slower of the two (a ring moves over all its links at once), summed, + latency
    latency_s: float  # of links_s: the collectives launched x the latency
    codec_s: float
    pays_below: float | None = None  # bytes/s: below it this option beats the plain one (None: the plain one)
    this_config: bool = False
    note: str = ""

    @property
    def total_s(self) -> float:
        return self.links_s + self.codec_s

    def as_dict(self) -> dict:
        return {"name": self.name, "set": self.settings, "cross_node_bytes": self.traffic.cross_node_bytes,
                "intra_node_bytes": self.traffic.intra_node_bytes, "by_op": self.traffic.by_op,
                "codec_elements": self.traffic.codec_passes, "network_s": self.network_s,
                "intra_node_s": self.intra_node_s, "links_s": self.links_s, "latency_s": self.latency_s,
                "collectives": sum(self.traffic.calls_by_op.values()), "codec_s": self.codec_s, "total_s": self.total_s,
                "pays_below_bytes_s": None if self.pays_below is None else
                (None if math.isinf(self.pays_below) else self.pays_below),
                "pays_at_any_bandwidth": self.pays_below is not None and math.isinf(self.pays_below),
                "this_config": self.this_config, "note": self.note}


@dataclass(frozen=True)
class NetworkPlan:
    links: Links
    rates: CodecRates
    nodes: int
    gpus_per_node: int
    options: list[Option] = field(default_factory=list)  # the plain one first
    recommended: Option | None = None
    verdict: str = ""

    def describe(self) -> str:
        head = (f"communication per step on {self.nodes} node(s) x {self.gpus_per_node}: network "
                f"{format_bandwidth(self.links.network)} per rank between nodes, "
                f"{self.links.intra_node / GB:.0f} GB/s inside a node; a collective {self.links.latency * 1e6:.3g} us"
                f"{'' if self.links.intra_node_latency is None else f', {self.links.intra_node_latency * 1e6:.3g} us inside a node'}; "
                f"(de)quantization {self.rates.source}")
        rows = [f"  {'option':<34}{'cross-node':>12}{'intra-node':>12}{'network':>10}{'in node':>10}"
                f"{'latency':>10}{'codec':>10}{'total':>10}  pays below"]
        for o in self.options:
            mark = " *" if o.this_config else ""
            rows.append(f"  {o.name + mark:<34}{o.traffic.cross_node_bytes / GB:>9.2f} GB{o.traffic.intra_node_bytes / GB:>9.2f} GB"
                        f"{_seconds(o.network_s):>10}{_seconds(o.intra_node_s):>10}{_seconds(o.latency_s):>10}"
                        f"{_seconds(o.codec_s):>10}"
                        f"{_seconds(o.total_s):>10}  {_pays(o)}")
        notes = [f"  {o.name}: {o.note}" for o in self.options if o.note]
        legend = ("  (* this config; per rank and optimizer step; total: each op waits for the slower of its network "
                  "and in-node parts, plus a latency per collective and the (de)quantization; pays below: the network "
                  "bandwidth under which it beats the first row)")
        return "\n".join([head, *rows, legend, *notes,
                          f"verdict (network): {self.verdict}"])

    def as_dict(self) -> dict:
        return {"bandwidth_bytes_s": self.links.network, "intra_node_bandwidth_bytes_s": self.links.intra_node,
                "latency_s": self.links.latency, "intra_node_latency_s": self.links.intra_node_latency,
                "codec_seconds_per_element": self.rates.seconds_per_element, "codec_source": self.rates.source,
                "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "options": [o.as_dict() for o in self.options],
                "recommended": self.recommended.name if self.recommended else None, "verdict": self.verdict}


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s" if s < 100 else f"{s:,.0f} s"


def _pays(option: Option) -> str:
    return "-" if option.pays_below is None else _bandwidth_text(option.pays_below)


def plan_network(cfg, shape: ModelShape, cluster: Cluster, links: Links, rates: CodecRates) -> NetworkPlan | None:
    """Every option for this config's stage, timed, with the one to use (None: a single rank)."""
    if cfg.world_size == 1:
        return None
    per_node = max(1, min(cluster.gpus_per_node, cfg.world_size))
    stage = cfg.zero_optimization.stage
    if stage == 3:
        candidates = _zero3_candidates(cfg, shape, per_node)
    elif stage in (0, 1):
        candidates = _allreduce_candidates(cfg, shape, per_node)
    else:
        candidates = [("ZeRO-2", {}, predict_traffic(cfg, shape, per_node), True, "")]
    timed = [_timed_option(links, rates, *c) for c in candidates]
    plain = timed[0]
    options = [plain] + [_with_break_even(o, plain, links) for o in timed[1:]]
    best = min(options, key=lambda o: o.total_s)
    if best is not plain and plain.total_s - best.total_s < WORTH_IT * plain.total_s:
        best = plain
    plan = NetworkPlan(links, rates, -(-cfg.world_size // per_node), per_node, options, best)
    return NetworkPlan(links, rates, plan.nodes, per_node, options, best, _verdict(plan, stage))


def links_seconds(traffic: Traffic, network: float, intra_node: float, latency: float = 0.0,
                  intra_node_latency: float | None = None) -> float:
    """The step's communication time without the codecs: each op takes as long as its slower link
    (a ring keeps every link busy at once, so its network and in-node parts overlap), and the ops
    follow one another (qgZ's node phase waits for the in-node phase); each collective launched
    adds ``latency``, or ``intra_node_latency`` when its ranks share a node."""
    moved = sum(max(cross / network, intra / intra_node) for intra, cross in traffic.links_by_op.values())
    return moved + latency_seconds(traffic, latency, intra_node_latency)


def latency_seconds(traffic: Traffic, latency: float, intra_node_latency: float | None = None) -> float:
    """The collectives' fixed costs: ``latency`` each, ``intra_node_latency`` for one inside a node."""
    inside = latency if intra_node_latency is None else intra_node_latency
    calls = sum(traffic.calls_by_op.values())
    return latency * (calls - traffic.in_node_calls) + inside * traffic.in_node_calls


def _timed_option(links: Links, rates: CodecRates, name: str, settings: dict, traffic: Traffic, this: bool,
                  note: str) -> Option:
    return Option(name, settings, traffic, traffic.cross_node_bytes / links.network,
                  traffic.intra_node_bytes / links.intra_node,
                  links_seconds(traffic, links.network, links.intra_node, links.latency, links.intra_node_latency),
                  latency_seconds(traffic, links.latency, links.intra_node_latency), rates.seconds(traffic.codec_passes),
                  this_config=this, note=note)


def break_even(option: Option, reference: Option, intra_node: float, lowest: float = 1e6, highest: float = 1e14,
               latency: float = 0.0, intra_node_latency: float | None = None) -> float:
    """The highest network bandwidth (bytes/s per rank) at which ``option`` is faster than
    ``reference``: ``inf`` when it is faster even at ``highest``, 0 when not even at ``lowest``.
    Faster means less time per step, so an option that saves network bytes for compute pays
    below this bandwidth."""
    def wins(bandwidth: float) -> bool:
        def seconds(o: Option) -> float:
            return links_seconds(o.traffic, bandwidth, intra_node, latency, intra_node_latency) + o.codec_s

        return seconds(option) < seconds(reference)

    if wins(highest):
        return math.inf
    grid = [lowest * (highest / lowest) ** (i / 200) for i in range(201)]
    winning = [b for b in grid if wins(b)]
    if not winning:
        return 0.0
    lo = max(winning)
    hi = grid[grid.index(lo) + 1]
    for _ in range(40):  # bisect between the last winning and the next losing grid point
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if wins(mid) else (lo, mid)
    return lo


def _with_break_even(option: Option, plain: Option, links: Links) -> Option:
    return Option(option.name, option.settings, option.traffic, option.network_s, option.intra_node_s,
                  option.links_s, option.latency_s, option.codec_s,
                  break_even(option, plain, links.intra_node, latency=links.latency,
                             intra_node_latency=links.intra_node_latency), option.this_config, option.note)


_ZEROPP = {"hpZ": "zero_hpz_partition_size", "qwZ": "zero_quantized_weights", "qgZ": "zero_quantized_gradients"}


def _zero3_candidates(cfg, shape: ModelShape, per_node: int) -> list[tuple]:
    zero = cfg.zero_optimization
    on = {part for part, key in _ZEROPP.items() if (getattr(zero, key) > 1 if part == "hpZ" else getattr(zero, key))}
    parts = ["qwZ", "qgZ"] if per_node == 1 else ["hpZ", "qwZ", "qgZ"]  # hpZ needs ranks sharing a node
    combos = [(), *[(p,) for p in parts]] + ([tuple(parts)] if len(parts) > 1 else [])
    out = []
    for combo in combos:
        updates = {key: (per_node if p == "hpZ" else True) if p in combo else (1 if p == "hpZ" else False)
                   for p, key in _ZEROPP.items()}
        settings = {f"zero_optimization.{_ZEROPP[p]}": updates[_ZEROPP[p]] for p in combo}
        variant = _with_zero(cfg, updates)
        name = "ZeRO-3" if not combo else ("ZeRO++ (" + " + ".join(combo) + ")" if len(combo) == 3 else
                                           "ZeRO-3 + " + " + ".join(combo))
        note = ""
        if "hpZ" in combo:
            secondary = PRECISION_BYTES[cfg.precision] * shape.params / per_node
            note = f"holds a secondary partition of {secondary / GB:.2f} GB per rank (1/{per_node} of the weights)"
        out.append((name, settings, predict_traffic(variant, shape, per_node), set(combo) == on, note))
    return out


def _with_zero(cfg, updates: dict):
    zero = cfg.zero_optimization.model_copy(update=updates)
    return cfg.model_copy(update={"zero_optimization": zero})


def _allreduce_candidates(cfg, shape: ModelShape, per_node: int) -> list[tuple]:
    optimizer = (cfg.optimizer.type if cfg.optimizer else "").lower().replace("_", "")
    params = cfg.optimizer.params if cfg.optimizer else {}
    stage = cfg.zero_optimization.stage
    plain_name = "all-reduce (ZeRO-0)" if stage == 0 else "ZeRO-1 (reduce-scatter + all-gather)"
    compressed = predict_compressed_traffic(cfg, shape, per_node)
    needs = "" if stage == 0 else "; needs zero_optimization.stage 0 (the compressed optimizers refuse ZeRO)"
    freeze = params.get("freeze_step", 100000)
    var_freeze = params.get("var_freeze_step", 100000)
    clipper = params.get("local_step_clipper", 16)
    plain = predict_traffic(cfg, shape, per_node)
    return [(plain_name, {}, plain, optimizer not in ("onebitadam", "zerooneadam"), ""),
            ("1-bit Adam", {"optimizer.type": "OneBitAdam"}, compressed, optimizer == "onebitadam",
             f"after freeze_step ({freeze}) warm-up steps of the plain all-reduce{needs}"),
            ("0/1 Adam", {"optimizer.type": "ZeroOneAdam"}, compressed, optimizer == "zerooneadam",
             f"compressed every step until var_freeze_step ({var_freeze}); then local steps sync every "
             f"1..local_step_clipper ({clipper}) steps, dividing this by up to {clipper}{needs}")]


def _verdict(plan: NetworkPlan, stage: int) -> str:
    """One sentence in the spirit of the field report's 25 Gbps rule: what to use at this bandwidth,
    what it saves, and the bandwidth where the (de)quantization stops paying."""
    plain, best, intra = plan.options[0], plan.recommended, plan.links.intra_node
    latency = {"latency": plan.links.latency, "intra_node_latency": plan.links.intra_node_latency}
    at = f"at {format_bandwidth(plan.links.network)} per rank between nodes"
    quantized = [o for o in plan.options if o.codec_s > 0]
    fastest = min(quantized, key=lambda o: o.total_s) if quantized else None
    if plan.nodes == 1:
        return (f"all {plan.gpus_per_node} ranks share one node: nothing crosses a network, so "
                f"{'quantizing only adds compute' if quantized else 'there is nothing to save'}: keep {plain.name}")
    if best is plain:
        if fastest is None:
            return f"{at} communication takes {_seconds(plain.total_s)} per step: keep {plain.name}"
        keep = "plain ZeRO-3" if stage == 3 else plain.name
        return (f"{at} the (de)quantization costs more than it saves ({fastest.name}: {_seconds(fastest.total_s)} "
                f"against {_seconds(plain.total_s)} per step; {_pays_phrase(break_even(fastest, plain, intra, **latency))}): "
                f"keep {keep}")
    sets = " ".join(f"--set {k}={_json(v)}" for k, v in best.settings.items())
    text = f"{at} {best.name} cuts communication from {_seconds(plain.total_s)} to {_seconds(best.total_s)} per step"
    if best.codec_s > 0:
        text += f" ({_seconds(best.codec_s)} of (de)quantization included)"
    text += f": use it ({sets})" + (f"; it {best.note}" if "secondary" in best.note else "")
    exact = min((o for o in plan.options if o.codec_s == 0), key=lambda o: o.total_s)
    if best.codec_s > 0 and exact is not best:
        text += f". Against {exact.name} (exact values), {_pays_phrase(break_even(best, exact, intra, **latency))}"
    elif fastest is not None:
        text += (f". Quantizing costs more than it saves here ({fastest.name}: {_seconds(fastest.total_s)}); "
                 f"{_pays_phrase(break_even(fastest, best, intra, **latency))}")
    return text


def _bandwidth_text(bandwidth: float) -> str:
    """The "pays below" column: a bandwidth, or "any" / "never"."""
    if math.isinf(bandwidth):
        return "any"
    return format_bandwidth(bandwidth) if bandwidth > 0 else "never"


def _pays_phrase(bandwidth: float) -> str:
    if math.isinf(bandwidth):
        return "it pays at any network bandwidth (it also shrinks the in-node traffic)"
    return f"it pays below {format_bandwidth(bandwidth)}" if bandwidth > 0 else "it pays at no network bandwidth"


def _json(value) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))
