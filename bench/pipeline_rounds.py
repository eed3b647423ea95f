"""The bubble bench's rounds summed up: each schedule's figure over the rounds (median, min,
max), and mcpar's schedules against torch.distributed.pipelining's on the same stages, round by
round (``bench/pipeline_bubble.py`` runs the rounds)."""

from __future__ import annotations

import statistics


def spread(per_round: dict[str, list[float]]) -> dict:
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v),
                   "per_round": v} for name, v in per_round.items()}


def real_model_ratios(rounds: list[tuple[dict, dict]]) -> dict:
    """The real model's throughput, round by round: each mcpar schedule over mcpar's 1F1B and
    over torch's ``Schedule1F1B``, each torch schedule over torch's ``Schedule1F1B`` (medians,
    min and max over the rounds)."""
    over_ours: dict[str, list[float]] = {}
    over_torch: dict[str, list[float]] = {}
    torch_over_torch: dict[str, list[float]] = {}
    for ours, peer in rounds:
        theirs = peer["schedules"]
        one_f = ours["1f1b"]["step_time_s_median"]
        torch_one_f = theirs.get("Schedule1F1B", {}).get("step_time_s_median")
        for name, figures in ours.items():
            over_ours.setdefault(name, []).append(one_f / figures["step_time_s_median"])
            if torch_one_f:
                over_torch.setdefault(name, []).append(
                    torch_one_f / figures["step_time_s_median"])
        for name, figures in theirs.items():
            if torch_one_f and "step_time_s_median" in figures:
                torch_over_torch.setdefault(name, []).append(
                    torch_one_f / figures["step_time_s_median"])
    return {"rounds": len(rounds),
            "throughput_over_mcpar_1f1b": spread(over_ours),
            "throughput_over_torch_1f1b": spread(over_torch),
            "torch_throughput_over_torch_1f1b": spread(torch_over_torch)}


def against_torch(rounds: list[tuple[dict, dict]]) -> dict:
    """mcpar's fixed-cost figures next to torch's own schedules, round by round (each round:
    mcpar's schedules, then torch's, on fresh processes): each mcpar schedule's bubble minus its
    torch counterpart's, in points, and every schedule's throughput over torch's 1F1B of the
    same round; medians over the rounds, and each round's figure for the spread."""
    counterpart = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble"}
    points: dict[str, list[float]] = {}
    ours_over: dict[str, list[float]] = {}
    theirs_over: dict[str, list[float]] = {}
    for ours, peer in rounds:
        theirs = peer["schedules"]
        one_f = theirs.get("Schedule1F1B", {}).get("step_time_s_median")
        for name, figures in ours.items():
            peer_figures = theirs.get(counterpart.get(name, ""), {})
            if "bubble" in peer_figures:
                points.setdefault(name, []).append(
                    100 * (figures["idle_fraction"] - peer_figures["bubble"]))
            if one_f:
                ours_over.setdefault(name, []).append(one_f / figures["step_time_s_median"])
        for name, figures in theirs.items():
            if one_f and "step_time_s_median" in figures:
                theirs_over.setdefault(name, []).append(one_f / figures["step_time_s_median"])

    summary = spread
    return {"rounds": len(rounds),
            "bubble_points_over_torch": summary(points),
            "throughput_over_torch_1f1b": summary(ours_over),
            "torch_throughput_over_torch_1f1b": summary(theirs_over),
            "torch_bubble": summary({name: [peer["schedules"][name]["bubble"]
                                            for _, peer in rounds
                                            if "bubble" in peer["schedules"].get(name, {})]
                                     for name in rounds[0][1]["schedules"]}),
            "mcpar_bubble": summary({name: [ours[name]["idle_fraction"] for ours, _ in rounds]
                                     for name in rounds[0][0]})}


def round_checks(bubbles: dict[str, dict], at_latency: dict[str, dict],
                 zb_h1_theory: float) -> dict[str, list[bool]]:
    """The issue's bounds in every round (``checks``' other entries read the first round
    alone): ZB-H1 within 2 points of its theory, with free messages and at the round's
    measured message latency; ZBV at most 5% with steps that overlap."""
    zb_h1 = bubbles["zb_h1"]["per_round"]
    found = {
        "zb_h1_within_2_points_of_theory_rounds":
            [100 * (b - zb_h1_theory) <= 2.0 for b in zb_h1],
        "zb_h1_within_2_points_of_theory_at_measured_latency_rounds":
            [100 * (b - t) <= 2.0 for b, t in zip(zb_h1, at_latency["zb_h1"]["per_round"],
                                                   strict=True)],
    }
    if "zbv@overlapped_steps" in bubbles:
        found["zbv_at_most_5_percent_with_overlapped_steps_rounds"] = [
            b <= 0.05 for b in bubbles["zbv@overlapped_steps"]["per_round"]]
    return found
