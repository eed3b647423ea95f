"""Every bench script still imports: a rename in the package must not leave a bench broken
until someone next runs it (the benches run for minutes, outside the suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_imports(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # benches import their sibling helpers
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)  # module level only: each bench runs under __main__
    assert callable(getattr(module, "main", None)) or module.__doc__, script


def test_each_ranking_layout_is_priced_alone_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/auto_ranking.py`` measures the planner's prediction of each layout by running it
    with every searched key set: the planner must then price that layout alone, unchanged."""
    from mcpar.auto_layout import SEARCHED, choose_layout
    from mcpar.config import load_config

    monkeypatch.syspath_prepend(str(BENCH))
    import auto_ranking

    assert len(auto_ranking.LAYOUTS) >= 12
    assert set(auto_ranking.BASE) == set(SEARCHED) - {"parallelism.experts",
                                                      "optimization.global_batch_size"}
    for name, keys in auto_ranking.LAYOUTS.items():
        settings = {**auto_ranking.BASE, **keys}
        cfg = load_config(None, auto_ranking.MODEL + [f"{k}={auto_ranking._value(v)}"
                                                      for k, v in settings.items()])
        auto = choose_layout(cfg, auto_ranking.WORKERS)
        assert auto.runners_up == [], name
        chosen = auto.chosen.settings
        assert all(chosen[k] == v for k, v in settings.items() if k in chosen), name


def test_spearman_of_the_ranking_bench() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from auto_ranking import spearman
    finally:
        sys.path.remove(str(BENCH))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)  # ties averaged


def test_a_ranking_run_is_repriced_on_its_own_profile(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, capsys) -> None:
    """``bench/auto_ranking_reprice.py`` prices a saved run's layouts again on the run's own
    profile: with the code unchanged each layout gets the run's prediction back; ``--set``
    replaces one measured field (and a field the profile lacks is refused, named)."""
    import json

    from test_sim_local import PROFILE

    from mcpar.auto_layout import choose_layout
    from mcpar.config import load_config
    from mcpar.sim.profilestore import PROFILE_ENV, machine_key, profile_document, save_profile

    monkeypatch.syspath_prepend(str(BENCH))
    import auto_ranking
    import auto_ranking_reprice

    saved = tmp_path / "profile.json"
    save_profile(PROFILE, saved)
    monkeypatch.setenv(PROFILE_ENV, str(saved))
    rows = []
    for name in ("dp4", "pp2_dp2_1f1b"):
        keys = {**auto_ranking.BASE, **auto_ranking.LAYOUTS[name]}
        cfg = load_config(None, auto_ranking.MODEL + [f"{k}={auto_ranking._value(v)}"
                                                      for k, v in keys.items()])
        step = choose_layout(cfg, auto_ranking.WORKERS).chosen.step_s
        rows.append({"layout": name, "predicted_step_s": step, "measured_step_s": 1.1 * step})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"profile": profile_document(PROFILE, machine_key()),
                               "layouts": rows, "spearman_rho": 1.0}))

    def reprice(*changes: str) -> dict:
        argv = ["auto_ranking_reprice.py", str(run)]
        for change in changes:
            argv += ["--set", change]
        monkeypatch.setattr(sys, "argv", argv)
        assert auto_ranking_reprice.main() == 0
        return json.loads(capsys.readouterr().out)

    same = reprice()
    assert [r["predicted_s"] for r in same["layouts"]] == pytest.approx(
        [r["predicted_step_s"] for r in rows], abs=1e-4)
    assert same["median_abs_step_error"] == pytest.approx(0.1, abs=1e-3)
    slower = reprice('collectives.ar=[0.05, 1e-9]')
    assert slower["layouts"][0]["predicted_s"] > same["layouts"][0]["predicted_s"] + 0.01
    monkeypatch.setattr(sys, "argv", ["x", str(run), "--set", "notes_typo.x=1"])
    with pytest.raises(SystemExit, match="no field notes_typo.x"):
        auto_ranking_reprice.main()


def test_the_reshard_grid_is_a_grid_of_valid_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/reshard_grid.py`` runs for minutes: here only that it names at least 16 pairs,
    each between two layouts the launcher accepts (a typo in a setting would fail every run of
    a pair), and that a chained pair's source pair comes before it."""
    from mcpar.commands.train import validate_for_training
    from mcpar.config import load_config

    monkeypatch.syspath_prepend(str(BENCH))
    import reshard_grid

    assert len(reshard_grid.PAIRS) >= 16
    order = list(reshard_grid.PAIRS)
    for name, pair in reshard_grid.PAIRS.items():
        assert pair.a in reshard_grid.LAYOUTS and pair.b in reshard_grid.LAYOUTS, name
        if pair.chained is not None:
            assert order.index(pair.chained) < order.index(name), name
            assert reshard_grid.PAIRS[pair.chained].b == pair.a, name
    for layout in reshard_grid.LAYOUTS.values():
        cfg = load_config(None, [*layout.settings, "training.steps=14",
                                 "optimization.checkpoint.interval=4"])
        validate_for_training(cfg, layout.nproc)  # raises UserError naming the key
    assert reshard_grid._selected("moe_experts4_to_2") == ["moe_experts2_to_4",
                                                           "moe_experts4_to_2"]


def test_a_ranking_run_on_emulated_nodes_is_launched_as_set(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path, capsys) -> None:
    """``bench/auto_ranking.py --nodes N``: each node's torchrun starts mcpar with the run's
    directory, steps and every layout key, on the CPU, and hands the local profile to the
    workers; a node count that does not split the 4 workers evenly is refused, named."""
    from mcpar.sim.profilestore import PROFILE_ENV

    monkeypatch.syspath_prepend(str(BENCH))
    import auto_ranking

    sets = ["parallelism.pipeline=2", "parallelism.data=2"]
    argv, env = auto_ranking.node_launch(sets, 6, tmp_path / "run", tmp_path / "profile.json")
    assert Path(argv[0]).name == "emulated_cluster.py" and argv[1:3] == ["_mcpar", "train"]
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path / "run")
    assert argv[argv.index("--steps") + 1] == "6"
    given = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert given == [*sets, "training.device=cpu"]
    assert env == {PROFILE_ENV: str(tmp_path / "profile.json")}

    assert auto_ranking.parse_args([]).nodes == 1  # default: this machine, as before
    assert auto_ranking.parse_args(["--nodes", "2", "--rate", "300mbit"]).nodes == 2
    for bad, says in ((["--nodes", "3"], "--nodes must divide the 4 workers"),
                      (["--nodes", "0"], "--nodes must divide the 4 workers"),
                      (["--nodes", "2", "--rate", "fast"], "--rate: cannot parse rate")):
        with pytest.raises(SystemExit) as exit_info:
            auto_ranking.parse_args(bad)
        assert exit_info.value.code == 2
        assert says in capsys.readouterr().err


def test_a_ranking_run_over_nodes_is_repriced_over_the_link_its_workers_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run over emulated nodes names its measured link in each layout's ranking line; the
    re-pricing reads it back (one node: none)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import auto_ranking_reprice

    said = ("this machine's calibrated local profile (p.json), 4 worker(s) in nodes of 2 "
            "rank(s) joined by a 1,285 Mbit/s link, 37 us (measured at start)")
    link = auto_ranking_reprice.run_nodes({"nodes": 2}, {"ranked_on": [said]})
    assert link is not None and link.ranks_per_node == 2
    assert (link.bandwidth, link.latency_s) == pytest.approx((1285e6 / 8, 37e-6))
    assert auto_ranking_reprice.run_nodes({"nodes": 1}, {}) is None
    with pytest.raises(SystemExit, match="does not say its link"):
        auto_ranking_reprice.run_nodes({"nodes": 2}, {"ranked_on": ["local"]})
