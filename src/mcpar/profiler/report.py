"""<run_dir>/profile/: report.json (every figure), report.md, report.html (self-contained: the
pictures are embedded as data URIs and there is no script or external link, so it opens offline
and can be mailed), the PNGs and the traces.

Both texts are rendered from the same sections (:data:`SECTIONS`), so they always agree.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from mcpar.path_checks import named, storage_errors
from mcpar.profiler import plots
from mcpar.profiler.analysis import analyse
from mcpar.profiler.bandwidth import format_bytes, format_rate
from mcpar.profiler.timeline import CATEGORIES

if TYPE_CHECKING:
    import torch

    from mcpar.config import JobConfig
    from mcpar.plan import JobPlan
    from mcpar.topology import ParallelDims

SECTIONS = {
    "overview": "Overview", "step-time": "Step time split", "communication": "Collectives",
    "memory": "Memory", "throughput": "Throughput and MFU", "bubble": "Pipeline bubble",
    "moe": "MoE load per expert", "stragglers": "Stragglers", "prediction": "Plan vs measured",
    "curves": "Loss and throughput", "files": "Traces and files",
}
GB = 1e9
GIB = 2.0**30


class ReportedRun(Protocol):
    """What the report reads of the run it describes (the Trainer is one), read-only."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def plan(self) -> JobPlan: ...
    @property
    def dims(self) -> ParallelDims: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def device_reason(self) -> str: ...
    @property
    def run_dir(self) -> Path: ...


@dataclass
class Section:
    id: str
    paras: list[str] = field(default_factory=list)
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return SECTIONS[self.id]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def build_sections(r: dict[str, Any], images: dict[str, str]) -> list[Section]:
    ctx, thr = r["context"], r["throughput"]
    s = {k: Section(k) for k in SECTIONS}
    s["overview"].paras = [
        f"Layout {ctx['layout']} on {ctx['world_size']} rank(s), device {ctx['device']}, "
        f"dtype {ctx['dtype']}; profiled steps {r['window']}.",
        f"Exposed communication share of step time: **{_pct(r['comm_share'])}** "
        f"(mean over ranks); step time {thr['step_s'] * 1e3:.1f} ms; "
        f"{thr['tokens_per_s']:.0f} tokens/s; MFU {_pct(thr['mfu'])}.",
    ]
    s["step-time"].paras = ["Seconds per step, mean over the window. exposed_comm: "
                            "communication not hidden behind compute, including a rank's wait "
                            "at a collective for a slower rank (see Stragglers); bubble: "
                            "waiting for another pipeline stage; idle: the rest."]
    s["step-time"].tables = [(
        ["rank", "step ms", *CATEGORIES, "comm share"],
        [[str(row["rank"]), f"{row['step_s'] * 1e3:.1f}",
          *[f"{row[c] * 1e3:.1f} ms ({_pct(row[c] / row['step_s'] if row['step_s'] else 0)})"
            for c in CATEGORIES], _pct(row["exposed_comm"] / row["step_s"] if row["step_s"]
                                       else 0)] for row in r["split"]])]
    s["step-time"].images = [images.get("comm_breakdown.png", ""), images.get("timeline.png", "")]
    s["communication"].paras = [
        "Per rank and step. bytes: what this rank sent under the ring algorithms; S: the "
        "collective's size; algbw = S / t and busbw = algbw x factor (2(n-1)/n all-reduce, "
        "(n-1)/n all-gather, reduce-scatter and all-to-all, 1 otherwise), as nccl-tests "
        "defines them, in 1e3-based units (1 GB/s = 1e9 B/s), over the time of the rank that "
        "joined last (min ms: the others' time holds their wait for it). An asynchronous "
        "collective's time runs from its launch to its completion, so queueing behind another "
        "one lowers its bandwidth."]
    s["communication"].tables = [(
        ["op", "axis", "codec", "n", "calls", "bytes sent", "S", "mean ms", "min ms",
         "algbw", "busbw"],
        [[c["op"], c["axis"], c["codec"], str(c["n"]), f"{c['calls']:.1f}",
          format_bytes(c["bytes"]), format_bytes(c["size_bytes"]), f"{c['time_s'] * 1e3:.2f}",
          f"{c['time_s_min'] * 1e3:.2f}", format_rate(c["algbw"]), format_rate(c["busbw"])]
         for c in r["collectives"]])]
    mem = r["memory"]
    names = [n for n in dict.fromkeys([*mem["estimate"], *mem["measured"]])]
    s["memory"].paras = [
        f"Capacity {mem['capacity_bytes'] / GIB:.2f} GiB per device; measured total of the "
        f"largest rank {float(mem['measured'].get('total', 0)) / GIB:.4f} GiB: "
        f"utilisation {_pct(mem['utilisation'])}."]
    s["memory"].tables = [(["category", "estimate MiB", "measured MiB"],
                           [[n, f"{mem['estimate'].get(n, 0) / 2**20:.2f}",
                             f"{mem['measured'].get(n, 0) / 2**20:.2f}"] for n in names])]
    s["memory"].images = [images.get("memory.png", "")]
    peak = thr.get("peak") or {}
    s["throughput"].paras = [
        f"{thr['tokens_per_s']:.0f} tokens/s over the window; MFU {_pct(thr['mfu'])} = "
        f"flops_per_token ({thr.get('flops_per_token', 0):.4g}) x tokens/s / peak "
        f"({peak.get('total', 0):.4g} FLOP/s = {peak.get('devices', 0)} x "
        f"{peak.get('flops_per_device', 0):.4g}); peak: {peak.get('source', 'unknown')}."]
    b = r["bubble"]
    s["bubble"].paras = [
        f"Measured {_pct(b['measured'])} against (p-1)/(v m+p-1) = {_pct(b['theory'])} "
        f"(p {b['stages']}, m {b['microbatches']}, v {b['virtual']})." if b["pipeline"]
        else "No pipeline in this layout."]
    s["moe"].paras = ["Not a MoE model." if r["moe"] is None else
                      "Tokens routed to each expert in the last profiled step, per layer."]
    if r["moe"]:
        s["moe"].tables = [(["layer", *[f"e{i}" for i in range(len(r["moe"][0]))]],
                            [[str(i), *map(str, row)] for i, row in enumerate(r["moe"])])]
    st = r["stragglers"]
    s["stragglers"].paras = [
        f"Own work per step (compute + optimizer + data); spread (max-min)/mean "
        f"{_pct(st['spread'])}; slowest rank {st['slowest_rank']}."]
    s["stragglers"].tables = [(["rank", "work ms", "step ms"],
                               [[str(k), f"{v * 1e3:.1f}", f"{st['step_s'][k] * 1e3:.1f}"]
                                for k, v in st["work_s"].items()])]
    s["prediction"].paras = [f"Source: {ctx['prediction_source']}."]
    if r["prediction"]:
        s["prediction"].tables = [(["figure", "predicted", "measured"],
                                   [[p["figure"], f"{p['predicted']:.4g}",
                                     f"{p['measured']:.4g}"] for p in r["prediction"]])]
    s["curves"].images = [images.get("curves.png", "")]
    if not images:
        for sec in s.values():
            sec.images = []
        s["curves"].paras = ["No pictures: matplotlib, a dependency of mcpar, is not "
                             "installed here (pip install -e . or pip install matplotlib)."]
    # Links relative to the report, which sits beside the files: they open from a copy of the
    # whole profile/ directory too.
    s["files"].paras = [f"[{name}]({name}) ({format_bytes(size)})"
                        for name, size in ctx["files"].items()] or ["No trace (trace off)."]
    for sec in s.values():
        sec.images = [i for i in sec.images if i]
    return list(s.values())


def to_markdown(sections: list[Section]) -> str:
    lines = ["# mcpar profile report", ""]
    for sec in sections:
        lines += [f"## {sec.title}", "", *[p + "\n" for p in sec.paras]]
        for headers, rows in sec.tables:
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
        lines += [f"![{Path(i).stem}]({i})" for i in sec.images] + [""]
    return "\n".join(lines)


def to_html(sections: list[Section], out_dir: Path) -> str:
    def para(text: str) -> str:
        # The markdown the sections use: **bold**, `code` and [text](relative link).
        text = re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(text))
        text = re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)",
                      lambda m: f'<a href="{quote(html.unescape(m[2]))}">{m[1]}</a>', text)
        parts = text.split("**")
        return "<p>" + "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts)) + "</p>"

    body = ["<h1>mcpar profile report</h1>"]
    for sec in sections:
        body.append(f'<section id="{sec.id}"><h2>{html.escape(sec.title)}</h2>')
        body += [para(p) for p in sec.paras]
        for headers, rows in sec.tables:
            body.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers)
                        + "</tr>")
            body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                     for row in rows]
            body.append("</table>")
        for image in sec.images:
            data = base64.b64encode((out_dir / image).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(image)}" src="data:image/png;base64,{data}">')
        body.append("</section>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
             "table{border-collapse:collapse;font-size:12px;margin:.5em 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "img{max-width:100%;display:block;margin:.5em 0}")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>mcpar profile report"
            f"</title><style>{style}</style></head><body>" + "\n".join(body)
            + "</body></html>\n")


def context_of(trainer: ReportedRun) -> dict[str, Any]:
    from mcpar.profiler.predict import predicted

    t, plan = trainer, trainer.plan
    pred, source = predicted(plan.config, t.dims.world_size, t.device,
                             plan.auto.nodes if plan.auto is not None else None)
    return {"layout": t.dims.describe(), "world_size": t.dims.world_size,
            "device": t.device_reason, "dtype": t.cfg.training.dtype, "pp": t.dims.pp,
            "microbatches": plan.num_microbatches, "virtual": plan.virtual_stages,
            "schedule": plan.compute.schedule, "capacity_bytes": _capacity(t.device),
            "prediction": pred, "prediction_source": source}


def _capacity(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _write_text(path: Path, text: str) -> None:
    """``path.write_text(text)``; a failed write names ``path`` (an open file's error does not)."""
    try:
        path.write_text(text)
    except OSError as err:
        raise named(err, path) from err


def write_report(out_dir: Path, ranks: list[dict], summary: dict[str, Any],
                 trainer: ReportedRun) -> Path:
    """Writes the report files; the path of report.html."""
    from mcpar.metrics import read_metrics

    # A full disk (a quota, a read-only place) under the profile folder is the user's to fix:
    # one line naming the file and --run-dir, not a traceback (nor a restart, on a worker).
    # report.html, the entry point, is written last: a report cut short has none.
    with storage_errors(out_dir, "--run-dir"):
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx = context_of(trainer)
        ctx["files"] = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())
                        if p.name.startswith(("trace_", "memory_snapshot_"))}
        report = analyse(ranks, summary, ctx)
        _write_text(out_dir / "report.json", json.dumps({"report": report, "ranks": ranks},
                                                        indent=1) + "\n")
        images: dict[str, str] = {}
        if plots.available():
            for path in plots.write_all(report, read_metrics(trainer.run_dir), out_dir):
                images[path.name] = path.name
        sections = build_sections(report, images)
        _write_text(out_dir / "report.md", to_markdown(sections))
        page = out_dir / "report.html"
        _write_text(page, to_html(sections, out_dir))
    return page
