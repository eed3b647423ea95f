"""The seed table's generator: its verdicts follow the numbers, and the committed table is the
generator's (both fabrics, every mechanism); regenerating it takes ~20 s, so that is not redone
here."""

from __future__ import annotations

from pathlib import Path

from mcpar.sim.seed_table import MECHANISMS, NEGLIGIBLE, fabrics, verdict
from mcpar.sim.workload import Layout

DOC = Path(__file__).resolve().parents[1] / "docs" / "seed_table.md"


def test_verdicts_follow_the_gain() -> None:
    assert verdict(0.2, True).startswith("buys 20.0%") and "uses it" in verdict(0.2, True)
    assert "nothing measurable" in verdict(NEGLIGIBLE / 2, False)
    assert "does not use it" in verdict(NEGLIGIBLE / 2, False)
    assert verdict(-0.1, False).startswith("costs 10.0%")
    assert "cannot be priced" in verdict(None, False)


def test_each_mechanism_is_recognised_in_a_layout() -> None:
    base = Layout(tp=4, dp=64, global_batch=256, precision="fp16", zero_stage=3)
    using = {
        "hierarchical all-reduce": base.with_(zero_stage=0, topology="hierarchical"),
        "1-bit Adam": base.with_(zero_stage=0, compression="1bit"),
        "ZeRO-3": base,
        "the parameter store (hpZ)": base.with_(allocation="topology_aware"),
        "int8 weight gathers (qwZ)": base.with_(weight_gather="int8"),
        "bf16 inter-node reduce-scatter": base.with_(allocation="topology_aware",
                                                     compression="bf16"),
        "int8 inter-node reduce-scatter (qgZ)": base.with_(allocation="topology_aware",
                                                           compression="int8"),
        "zero-bubble schedules (ZB-H1, ZB-H2, ZBV)": base.with_(zero_stage=0, pp=4, dp=16,
                                                           schedule="zb_h1"),
    }
    assert set(using) == {mech.name for mech in MECHANISMS}
    for mech in MECHANISMS:
        assert mech.uses(using[mech.name]), mech.name
        assert not mech.uses(base.with_(zero_stage=1, topology="flat")), mech.name


def test_the_committed_table_covers_both_fabrics_and_every_mechanism() -> None:
    text = DOC.read_text()
    assert "python -m mcpar.sim.seed_table" in text
    for fab in fabrics():
        assert f"## {fab.name}" in text
    for mech in MECHANISMS:
        assert f"| {mech.name} |" in text and f"  - {mech.name} " in text
    slow = fabrics()[-1].cluster
    assert slow.inter_bw * slow.gpus_per_node * 8 == 100e9  # 100 Gb/s per node, not per GPU
