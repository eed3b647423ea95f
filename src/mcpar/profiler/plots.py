"""The report's pictures (matplotlib, Agg: no display needed): PNG files in <run_dir>/profile/.

- ``timeline.png``: the last profiled step's tasks per rank, coloured by kind;
- ``comm_breakdown.png``: each rank's step split into compute, exposed communication, bubble,
  optimizer, data and idle, and the collectives' seconds per operation and axis;
- ``memory.png``: memory per category, estimate against measurement, with the capacity; and
  the memory allocated over the last profiled step, per rank (from the trace's allocator events);
- ``curves.png``: loss and tokens/s over the run's steps (metrics.jsonl).

matplotlib is a dependency of mcpar; in an environment that lacks it anyway the report is written
without pictures and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "recv_activation": "#c44e52",
           "recv_grad": "#dd8452", "wait_sends": "#937860", "send_activation": "#8172b3",
           "send_grad": "#8172b3", "sync_grads": "#da8bc3", "wait_grads": "#e377c2",
           "optimizer_step": "#ccb974", "compute": "#4c72b0", "exposed_comm": "#e377c2",
           "bubble": "#c44e52", "optimizer": "#ccb974", "data": "#64b5cd", "idle": "#bbbbbb"}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline(report: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    ranks = report["timeline"]["ranks"]
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.45 * len(ranks)))
    seen: set[str] = set()
    for r, tasks in enumerate(ranks):
        for t in tasks:
            if t["end"] <= t["start"]:
                continue
            label = None if t["name"] in seen else t["name"]
            seen.add(t["name"])
            ax.barh(r, t["end"] - t["start"], left=t["start"], height=0.8,
                    color=COLOURS.get(t["name"], "#999999"), label=label)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since each rank's own step start")
    ax.set_title(f"Tasks of step {report['timeline']['step']}, per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return _save(fig, path)


def _legend_above(ax: Any, ncol: int) -> None:
    """The legend in a row over the axes, under the title: inside, it would hide a bar."""
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=ncol, fontsize=7,
              frameon=False, borderaxespad=0.0, columnspacing=1.2, handlelength=1.5)


def comm_breakdown(report: dict[str, Any], path: Path) -> Path:
    return _save(comm_breakdown_figure(report), path)


def comm_breakdown_figure(report: dict[str, Any]) -> Any:
    from mcpar.profiler.timeline import CATEGORIES

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    split = report["split"]
    bottom = [0.0] * len(split)
    for cat in CATEGORIES:
        values = [row[cat] for row in split]
        left.bar([f"rank {row['rank']}" for row in split], values, bottom=bottom, label=cat,
                 color=COLOURS[cat])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_ylabel("seconds per step")
    left.set_title("Step time split", pad=22)
    _legend_above(left, ncol=len(CATEGORIES))
    rows = report["collectives"] or [{"op": "none", "axis": "", "time_s": 0.0}]
    right.barh([f"{r['op']} [{r['axis']}]" for r in rows], [r["time_s"] for r in rows],
               color="#e377c2")
    right.set_xlabel("seconds per step (per rank, hidden or not)")
    right.set_title("Collectives", pad=22)
    return fig


def memory(report: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    est, meas = report["memory"]["estimate"], report["memory"]["measured"]
    names = [n for n in dict.fromkeys([*est, *meas]) if n != "total"]
    fig, (ax, over) = plt.subplots(1, 2, figsize=(12, 3.8),
                                   gridspec_kw={"width_ratios": [3, 2]})
    xs = range(len(names))
    gib = 2.0**30
    ax.bar([x - 0.2 for x in xs], [est.get(n, 0) / gib for n in names], 0.4, label="estimate")
    ax.bar([x + 0.2 for x in xs], [meas.get(n, 0) / gib for n in names], 0.4, label="measured")
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GiB (largest rank)")
    cap = report["memory"]["capacity_bytes"]
    ax.set_title(f"Per category (capacity {cap / gib:.1f} GiB; measured total "
                 f"{meas.get('total', 0) / gib:.3f} GiB)", fontsize=9, pad=16)
    _legend_above(ax, ncol=2)
    series = report["memory"].get("over_step", {})
    for rank, points in series.items():
        if points:
            over.plot([p[0] for p in points], [p[1] / 2**20 for p in points],
                      label=f"rank {rank}", linewidth=1)
    if any(series.values()):
        over.legend(fontsize=7)
    else:
        over.text(0.5, 0.5, "no trace (training.profile.trace: false)", ha="center",
                  transform=over.transAxes)
    over.set_xlabel("ms since the step's start")
    over.set_ylabel("MiB allocated since the window opened")
    over.set_title("Over the last profiled step", fontsize=9)
    return _save(fig, path)


def curves(metrics: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
    steps = [m["step"] for m in metrics]
    left.plot(steps, [m["loss"] for m in metrics], marker=".")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    right.plot(steps, [m["tokens_per_s"] for m in metrics], marker=".", color="#55a868")
    right.set_xlabel("step")
    right.set_ylabel("tokens/s")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _plt().close(fig)
    return path


def write_all(report: dict[str, Any], metrics: list[dict[str, Any]], out: Path) -> list[Path]:
    return [timeline(report, out / "timeline.png"),
            comm_breakdown(report, out / "comm_breakdown.png"),
            memory(report, out / "memory.png"), curves(metrics, out / "curves.png")]
