"""MoE expert load balancing: static, greedy and the learning policy on non-stationary routing
traces priced with measured costs, and on the real MoE model.

Section 1, traces (default)
    ``ExpertLoadBalancer`` under each policy is fed the SAME routing, trace by trace:

    - three synthetic non-stationary traces (``bench/routing_traces.py``, whose
      docstring says what each models and why it is realistic): ``zipf_shift`` (Zipf 0.8
      popularity whose ranking is redrawn at random times, segments of 150 steps on average),
      ``bursts`` (a mild Zipf 0.5 base, plus bursts of 2 experts taking 30% of the assignments
      for 5 steps on average, 4% chance per step and layer) and ``drift`` (log-popularities
      following an Ornstein-Uhlenbeck walk, spread 0.8, correlation time 300 steps); 32 experts
      over 4 expert ranks, 2 MoE layers, 16384 assignments per layer and step (8192 tokens,
      top-2), ``--steps`` 3000 steps, for each of ``--seeds``;
    - the routing the real MoE model produced on the default corpus (``--recorded``, written
      by ``--record-routing``: 300 steps, 2 layers, 8 experts, top-2, no routing-side
      balancing), placed over 4 ranks.

    Costs (seconds): the ``StepCostModel`` with the prices ``bench/moe_balance_costs.py``
    MEASURED (``--costs``): an expert of 1024 x 4096, its forward + backward per assignment on
    this CPU, its all-to-all bytes, and the wall time of sending it with its Adam state over
    loopback gloo and over an emulated 100 Mbit/s link; every trace is priced once per link. A
    step costs the wait on the slowest rank (excess assignments x seconds per assignment) plus
    the migrations decided in it. The recorded trace comes from a smaller model; it keeps its
    routing and takes the same prices, i.e. its experts are priced as the bench's expert size.

    Policies: static; greedy (fixed rule, horizon 1/(1-0.99) = 100 steps, its fixed migration
    cost configured at the measured price: the strongest greedy one could configure); the
    learning agent; and the agent with learning off, ``frozen`` (it follows greedy's rule
    throughout) and ``random`` (a random rule per decision).

    Targets (one boolean each in the JSON, over the (trace, link) cases, mean over seeds): the
    learned policy <= 0.95 x greedy in cases of at least two different traces and <= 1.02 x
    greedy in every case; both ablations >= 1.03 x the learned policy in winning cases of at
    least two different traces (the JSON lists every case's ratios, shortfalls included); and
    the learned policy <= 1.02 x min(static, greedy) in every case (a boolean per case).

Results (this 2-core machine, shared; ``--seeds 0 1 2``, means over the seeds; costs in s/step;
best = min(static, greedy))
    trace@link         static  greedy  learned  frozen  random  learned/greedy  learned/best
    zipf_shift@loop    2.217   0.366   0.361    0.366   0.557   0.987           0.987
    zipf_shift@100mbit 7.914   2.711   2.764    2.711   3.794   1.020           1.0198
    bursts@loopback    1.420   0.557   0.495    0.557   0.543   0.887           0.887
    bursts@100mbit     5.070   5.707   1.939    5.707   4.061   0.340           0.382
    drift@loopback     1.622   0.451   0.441    0.451   0.600   0.977           0.977
    drift@100mbit      5.790   5.397   3.440    5.397   5.243   0.637           0.637
    recorded@loopback  0.171   0.163   0.160    0.163   0.166   0.983           0.983
    recorded@100mbit   0.612   0.914   0.612    0.914   0.905   0.670           1.000
    Every target is met; learned <= 1.02 x best in all 8 cases, zipf_shift@100mbit only just
    (seeds 1.011 1.002 1.045). Ablations: frozen/learned and random/learned >= 1.03 in
    bursts@loopback, bursts@100mbit, drift@100mbit and recorded@100mbit.
    History of zipf_shift@100mbit (learned/greedy): 1.018 while staying was scored from the
    starting placement, but recorded@100mbit was then 1.289 x static (greedy's first move, 2
    experts at step 9, left a placement that replaying the trace shows waiting longer than
    static's: 0.761 against 0.623 s at step 49); 1.186 once staying was scored from the current
    placement (re-synced at every decision, it retook the lead after each move: replaying seed
    0, staying led 83 of 300 decisions, being charged balanced waits without the migrations
    that bought them); 1.040 with staying's shadow re-synced only while staying leads; now
    1.020, from two changes to the agent (``placement_agent.py`` states both and the replays
    behind them): a rule's migrations are charged over the objective's horizon (1% of what it
    still owes per step) instead of at once, since charged at once they made greedy's rule
    look dearer than H30 right after each big move and H30 led 65 of 300 decisions on seed 0
    (37 now); and the first leader is the shortest-horizon rule instead of staying, since
    delaying greedy's first move by one decision alone costs 1.014 1.024 1.048 x greedy on
    seeds 0 1 2. On seeds 3 to 12 (never used to choose anything) learned/best on
    zipf_shift@100mbit goes from 1.068 to 1.029 on average: the remaining gap there is mostly
    the path-dependence of the placement after the first move (greedy's own rule delayed by
    one decision: 0.972 to 1.045, mean 1.005, on those seeds), not a worse rule being followed
    (on seed 2 the agent follows greedy's rule from step 19 on and costs 1.045).
    Before these, the previous results were: learned 0.366 0.492 2.167 0.444 3.445 0.162 0.612
    s/step on zipf_shift@loop, bursts@loop, bursts@100mbit, drift@loop, drift@100mbit,
    recorded@loop, recorded@100mbit, 2.820 on zipf_shift@100mbit. Checked then (at 1.186 or
    1.040) and not helping: re-syncing EVERY rule's shadow at each decision (1.41 1.81 1.54 x
    greedy on seeds 0 1 2: a moving rule pays its migrations and is reset before the move has
    earned) and a 0% switch margin (1.12 1.18 1.21).

Section 2, real model (``--real``: after the traces; ``--real-only``: instead): see
    ``bench/moe_balance_real.py``: ``mcpar train`` on the real MoE model with 4 expert ranks,
    once per policy, on loopback and (``--real-emulated``) on 2 emulated nodes at 100 Mbit/s.

How to run
    python bench/moe_balance_costs.py          # once: the measured prices (needs root for 100mbit)
    python bench/moe_balance.py --record-routing  # once: the real model's routing (~7 min)
    python bench/moe_balance.py [--seeds 0 1 2] [--steps 3000] [--out FILE]
        [--real | --real-only] [--real-emulated] [real-model options, see --help]

    Prints one JSON object on stdout. The trace section takes about 3 minutes per seed on one
    core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from routing_traces import TRACES, StepCostModel, make_trace, run_policy

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DATA = BENCH / "data"
VARIANTS = (("static", "static", "on"), ("greedy", "greedy", "on"),
            ("learned", "reinforcement", "on"), ("frozen", "reinforcement", "frozen"),
            ("random", "reinforcement", "random"))
RECORD_SETTINGS = [
    "model.kind=moe", "model.num_experts=8", "model.top_k=2", "model.num_layers=2",
    "model.hidden_size=64", "model.num_heads=4", "model.seq_len=64",
    "model.ffn_hidden_size=2048", "model.router_bias_update_rate=0", "model.aux_loss_coef=0",
    "optimization.micro_batch_size=8", "training.seed=1234", "training.eval_interval=0",
    "training.eval_batches=1", "training.progress=false",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000, help="steps of each synthetic trace")
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks")
    p.add_argument("--layers", type=int, default=2, help="MoE layers")
    p.add_argument("--assignments", type=int, default=16384,
                   help="(token, expert) assignments per layer and step")
    p.add_argument("--interval", type=int, default=10, help="steps between decisions")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds of the traces and of the balancers")
    p.add_argument("--traces", nargs="+", default=[*TRACES, "recorded"],
                   choices=[*TRACES, "recorded"])
    p.add_argument("--costs", default=str(DATA / "moe_balance_costs.json"),
                   help="measured prices (bench/moe_balance_costs.py)")
    p.add_argument("--recorded", default=str(DATA / "moe_routing_default_corpus.json"),
                   help="the real model's routing (--record-routing)")
    p.add_argument("--record-routing", action="store_true",
                   help="train the real MoE model on the default corpus and write --recorded")
    p.add_argument("--record-steps", type=int, default=300)
    p.add_argument("--out", help="also write the JSON here")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--real", action="store_true", help="also the real-model section")
    which.add_argument("--real-only", action="store_true", help="only the real-model section")
    from moe_balance_real import add_real_args
    add_real_args(p)
    args = p.parse_args(argv)
    for name in ("steps", "experts", "ep", "layers", "assignments", "interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.experts % args.ep:
        p.error(f"--experts {args.experts} does not divide over --ep {args.ep}")
    return args


def record_routing(args: argparse.Namespace) -> dict:
    """Train the real MoE model on one process and keep its tokens per expert per step."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", "1", "--run-dir",
               str(run_dir), "--steps", str(args.record_steps)]
        for item in RECORD_SETTINGS:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
        records = [json.loads(line) for line in
                   (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    counts = [[layer["tokens_per_expert"] for layer in r["moe"]["layers"]] for r in records]
    out = {"what": "tokens per expert (top-2 assignments) of every MoE layer at every step of a "
                   "real `mcpar train` run of the MoE model on the default corpus (data.source "
                   "stdlib); routing does not depend on the layout",
           "settings": RECORD_SETTINGS, "steps": len(counts), "layers": len(counts[0]),
           "experts": len(counts[0][0]), "final_loss": records[-1]["loss"], "counts": counts}
    Path(args.recorded).write_text(json.dumps(out) + "\n")
    return {key: value for key, value in out.items() if key != "counts"}


def link_models(path: str) -> tuple[dict[str, StepCostModel], dict]:
    measured = json.loads(Path(path).read_text())
    models = {kind: StepCostModel(link["seconds_per_excess_assignment"], link["migration_s"])
              for kind, link in measured["links"].items() if "migration_s" in link}
    if not models:
        raise SystemExit(f"{path} holds no measured link; run bench/moe_balance_costs.py")
    return models, measured


def trace_counts(name: str, args: argparse.Namespace, seed: int) -> np.ndarray:
    if name == "recorded":
        return np.array(json.loads(Path(args.recorded).read_text())["counts"])
    return make_trace(name, args.steps, args.layers, args.experts,
                      assignments=args.assignments, seed=seed)


def trace_section(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    models, measured = link_models(args.costs)
    cases: dict[str, dict] = {}
    for name in args.traces:
        seeds = [0] if name == "recorded" else args.seeds  # the recording is one run
        for kind, model in models.items():
            per_seed = []
            for seed in seeds:
                counts = trace_counts(name, args, seed)
                ep = args.ep
                per_seed.append({label: run_policy(policy, counts, ep, model, seed=seed,
                                                   interval=args.interval,
                                                   learning=learning)["mean_cost_s"]
                                 for label, policy, learning in VARIANTS})
            mean = {label: float(np.mean([s[label] for s in per_seed]))
                    for label, _, _ in VARIANTS}
            best_fixed = mean["learned"] / min(mean["static"], mean["greedy"])
            case = {"trace": name, "link": kind, "seeds": seeds,
                    "mean_cost_s": mean, "per_seed_cost_s": per_seed,
                    "learned_over_greedy": mean["learned"] / mean["greedy"],
                    "learned_over_best_fixed": best_fixed,
                    "learned_le_1.02_best_fixed": best_fixed <= 1.02,
                    "static_over_greedy": mean["static"] / mean["greedy"],
                    "frozen_over_learned": mean["frozen"] / mean["learned"],
                    "random_over_learned": mean["random"] / mean["learned"]}
            cases[f"{name}@{kind}"] = case
            print(f"{name}@{kind}: " + ", ".join(f"{k}={v:.4g}" for k, v in case.items()
                                                  if k.endswith(("greedy", "learned"))),
                  file=sys.stderr)
    wins = [c for c in cases.values() if c["learned_over_greedy"] <= 0.95]
    ablated = [c for c in wins
               if c["frozen_over_learned"] >= 1.03 and c["random_over_learned"] >= 1.03]
    targets = {
        "learned_le_0.95_greedy_on_two_traces": {
            "cases": sorted(f"{c['trace']}@{c['link']}" for c in wins),
            "met": len({c["trace"] for c in wins}) >= 2},
        "learned_le_1.02_greedy_everywhere": {
            "worst": max(c["learned_over_greedy"] for c in cases.values()),
            "met": all(c["learned_over_greedy"] <= 1.02 for c in cases.values())},
        "learned_le_1.02_min_static_greedy_everywhere": {
            "cases": {key: c["learned_le_1.02_best_fixed"] for key, c in cases.items()},
            "worst": max(c["learned_over_best_fixed"] for c in cases.values()),
            "met": all(c["learned_le_1.02_best_fixed"] for c in cases.values())},
        "ablations_ge_1.03_learned_on_two_winning_traces": {
            "cases": sorted(f"{c['trace']}@{c['link']}" for c in ablated),
            "met": len({c["trace"] for c in ablated}) >= 2},
    }
    return {"geometry": {"experts": args.experts, "ep": args.ep, "layers": args.layers,
                         "assignments_per_layer_step": args.assignments, "steps": args.steps,
                         "interval": args.interval},
            "measured_costs": measured, "cases": cases, "targets": targets,
            "all_targets_met": all(t["met"] for t in targets.values()),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report: dict = {"bench": "moe_balance"}
    if args.record_routing:
        report["recorded"] = record_routing(args)
    elif not args.real_only:
        report["traces"] = trace_section(args)
    if args.real or args.real_only:
        from moe_balance_real import real_model_section
        report["real_model"] = real_model_section(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    main()
