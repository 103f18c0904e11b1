"""``raydeep bench``'s output: a markdown table (also what it prints) and a PNG chart."""
from __future__ import annotations


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _overlap(choice) -> str:
    """How the rows' overlap_comm was set (``--overlap``)."""
    choice = list(choice or [None])
    if choice == [None]:
        return "DeepSpeed's default (off at stages 1-2, on at 3, as the DeepSpeed rows)"
    return "off and on (a row each)" if len(choice) == 2 else ("on" if choice[0] else "off")


def markdown(summary: dict) -> str:
    s, m = summary["setup"], summary["machine"]
    peers = "DDP, torch ZeRO-1, FSDP2" + (", DeepSpeed" if m["deepspeed"] else " (DeepSpeed not installed)")
    lines = [f"**{s['model']}** (n_layer {s['n_layer'] or 'default'}), {summary['params'] / 1e6:.2f}M parameters, "
             f"{s['world']} gloo ranks ({m.get('ranks', 'local processes')}) x {s['threads']} thread(s), micro batch {s['micro_batch']} x seq {s['seq']}, "
             f"GAS {s['gas']}, {s.get('dtype', 'fp32')} AdamW, clip {1.0}; {s['steps']} interleaved rounds after {s['warmup']} warm-up; "
             f"bucket {s['bucket']:,} elements; raydeep's overlap_comm "
             f"{_overlap(s.get('overlap'))}; against {peers}.",
             f"{m['date']}, {m['cpus']} CPUs, 1-minute load average {m['load_average_start']:.1f} at start and "
             f"{m['load_average_end']:.1f} at end; torch {m['torch']}; {m['seconds']:.0f} s.",
             "",
             "| contender | stage | median ms | IQR ms | vs DDP | vs DeepSpeed | vs torch peer | max abs loss diff "
             "| model states MB/rank (formula) | comm MB/step (predicted) | comm blocked ms |",
             "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in summary["rows"]:
        states = "-" if r["state_bytes"] is None else _mb(max(r["state_bytes"]))
        comm = "-" if r["comm_bytes_per_step"] is None else \
            f"{_mb(r['comm_bytes_per_step'])} ({_mb(r['comm_bytes_predicted'])})"
        blocked = "-" if r["blocked_comm_s"] is None else f"{1e3 * r['blocked_comm_s']:.1f}"
        lines.append(f"| {r['name']} | {r['stage']} | {1e3 * r['median_s']:.1f} | {1e3 * r['q1_s']:.0f}-"
                     f"{1e3 * r['q3_s']:.0f} | {_ratio(r['vs_ddp'])} | {_ratio(r['vs_deepspeed'])} | "
                     f"{_ratio(r['vs_peer'])} | {r['loss_max_abs_diff']:.1e} | {states} ({_mb(r['state_bytes_formula'])}) "
                     f"| {comm} | {blocked} |")
    if summary.get("hidden_comm_share"):
        shares = ", ".join(f"z{k} {100 * v:.0f}%" for k, v in summary["hidden_comm_share"].items())
        lines += ["", f"Blocked time hidden by `overlap_comm` (1 - blocked on / blocked off): {shares}."]
    return "\n".join(lines)


def chart(summary: dict, path: str):
    """Median step time per contender (quartiles as error bars), grouped by ZeRO stage. Returns the
    (closed) matplotlib Figure, whose artists say what the PNG shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"raydeep": "#1f4e99", "deepspeed": "#c0392b", "ddp": "#7f8c8d", "torch-zero": "#95a5a6",
              "fsdp2": "#e67e22"}
    rows = sorted(summary["rows"], key=lambda r: (r["stage"], r["family"] != "raydeep", r["name"]))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 4.8))
    x = list(range(len(rows)))
    medians = [1e3 * r["median_s"] for r in rows]
    errors = [[1e3 * (r["median_s"] - r["q1_s"]) for r in rows], [1e3 * (r["q3_s"] - r["median_s"]) for r in rows]]
    ax.bar(x, medians, yerr=errors, capsize=3, color=[colors[r["family"]] for r in rows])
    ax.set_xticks(x, [r["name"] for r in rows], rotation=45, ha="right")
    for stage in range(1, 4):  # a divider before each stage's group
        first = next((i for i, r in enumerate(rows) if r["stage"] == stage), None)
        if first:
            ax.axvline(first - 0.5, color="black", linewidth=0.6, linestyle=":")
    s = summary["setup"]
    ax.set_ylabel("median ms per optimizer step")
    ax.set_title(f"{s['model']}: {summary['params'] / 1e6:.2f}M parameters, {s['world']} ranks, "
                 f"{s['steps']} interleaved rounds (bars: quartiles)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
