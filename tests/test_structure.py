"""The tree's structure, checked: layering without import circles, small files, a trainer that
neither inspects the optimizer's type nor injects faults."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
MAX_LINES = 600


def test_no_source_file_is_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these files: {long}"


def test_import_contracts_are_kept() -> None:
    """The layering, the controllers' independence and the absence of import circles
    (pyproject.toml's [tool.importlinter] contracts)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]'")
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


# The trainer: its loop and builds, and its update at each step's end.
TRAINER_FILES = ("trainer.py", "step_update.py")


def _trainer_source() -> str:
    return "\n".join((SRC / "mcpar" / name).read_text() for name in TRAINER_FILES)


def _trainer_tree() -> ast.Module:
    return ast.parse(_trainer_source())


def test_the_trainer_never_checks_the_optimizer_type() -> None:
    offending = []
    for node in ast.walk(_trainer_tree()):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("isinstance", "type", "getattr", "hasattr"):
            text = ast.unparse(node)
            if "optimizer" in text or "OneBitAdam" in text or "AdamW" in text:
                offending.append(text)
    assert offending == []


def test_the_trainer_holds_no_fault_injection() -> None:
    source = _trainer_source()
    for needle in ("MCPAR_FAULT", "os.environ", "time.sleep", "fault_rank", "fault_steps"):
        assert needle not in source, needle
    # What a test injects reaches the trainer as one object, called at its two hook points:
    # before a step, and after an update before the consistency check's reference is recorded.
    assert source.count("self.faults.") == 2


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
CODEC_NAMES = ("fp16", "bf16", "1bit", "powersgd", "int8")


def _string_literals(path: Path) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_schedule_names_live_in_their_registry_entries_only() -> None:
    """A consumer that tested a schedule's name would not know a registered plug-in."""
    allowed = {"mcpar/controllers/compute/pipeline_schedules.py",  # the entries
               "mcpar/registry/schedule.py"}  # the defaults (1f1b; interleaved with chunks)
    found = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if set(_string_literals(p)) & set(SCHEDULE_NAMES)}
    assert found <= allowed, found - allowed


def _codec_name_tests(path: Path) -> int:
    """Comparisons of a codec name with something called compression or codec."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {s.value for s in ast.walk(node) if isinstance(s, ast.Constant)}
        if names & set(CODEC_NAMES) and any(
                "compression" in ast.unparse(s) or "codec" in ast.unparse(s) for s in sides):
            count += 1
    return count


def test_codec_names_are_tested_only_where_no_entry_owns_the_rule_yet() -> None:
    """A ratchet: the codec entries (``controllers/communication/codecs.py``) hold every codec
    rule, price and build; these sites still name a codec, each for a reason, and none may be
    added (a new codec rule goes into its entry)."""
    remaining = {
        # the parameter store's own wire kernels (int8 / bf16 inter-node stage, int8 gathers)
        "mcpar/controllers/memory/param_store.py": 3,
        # the seed table's list of mechanisms, each a layout predicate
        "mcpar/sim/seed_table.py": 3,
        # 1-bit Adam keeps optimizer state of its own: offload refuses it (a memory rule)
        "mcpar/capabilities.py": 1,
        # PowerSGD's start step against training.steps, and onebit_adam beside another codec
        # (config-only rules); optimization.optimizer onebit_adam is the 1bit codec asked by
        # another key
        "mcpar/controllers/communication/plan.py": 3,
    }
    found = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
             if (n := _codec_name_tests(p)) and "communication/codecs.py" not in str(p)}
    assert found == remaining


# The config's controller sections and pipeline keys are read where the plan is made: the config
# package, the job plan, each controller's plan module and the MemoryController's planners (the
# placement to a budget and the estimate it searches with), and the simulator's translation of
# a config into its layout. The runtime (trainer, checkpoints, meter, profiler, executors,
# exchanges, store, offload) reads plans.
PLANNING_MODULES = (
    "mcpar/config/", "mcpar/plan.py", "mcpar/controllers/compute/plan.py",
    "mcpar/controllers/memory/plan.py", "mcpar/controllers/communication/plan.py",
    "mcpar/controllers/memory/placement.py", "mcpar/controllers/memory/estimate.py",
    "mcpar/controllers/memory/zero_plan.py", "mcpar/sim/fromconfig.py",
    # parallelism.auto's choice of the layout, made before the plan is resolved.
    "mcpar/auto_layout.py",
    # Checks of a config before it is planned (what this version cannot train, paths).
    "mcpar/capabilities.py", "mcpar/path_checks.py",
)
PLAN_KEYS = (("controllers",), ("parallelism", "schedule"), ("parallelism", "virtual_stages"))


def _plan_key_reads(tree: ast.AST) -> list[str]:
    """``<x>.controllers`` and ``<x>.parallelism.schedule`` / ``.virtual_stages`` reads."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        for key in PLAN_KEYS:
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute) and len(chain) < len(key):
                chain.insert(0, value.attr)
                value = value.value
            if tuple(chain) == key:
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_controller_sections_are_read_only_where_the_plan_is_made() -> None:
    offending = {}
    for path in (SRC / "mcpar").rglob("*.py"):
        rel = str(path.relative_to(SRC))
        if rel.startswith(PLANNING_MODULES):
            continue
        reads = _plan_key_reads(ast.parse(path.read_text()))
        if reads:
            offending[rel] = reads
    assert offending == {}, f"read the plan instead: {offending}"


def test_the_ratchet_sees_a_read_of_the_config() -> None:
    """The check above finds the reads it looks for (and not a plan's attribute)."""
    tree = ast.parse("z = cfg.controllers.memory.zero_stage\ns = self.cfg.parallelism.schedule\n"
                     "ok = plan.compute.schedule\nv = cfg.parallelism.virtual_stages\n")
    assert sorted(r.split(" ")[0] for r in _plan_key_reads(tree)) == [
        "cfg.controllers", "cfg.parallelism.virtual_stages", "self.cfg.parallelism.schedule"]


def test_the_trainer_constructor_is_an_ordered_list_of_builds() -> None:
    init = next(node for node in ast.walk(_trainer_tree())
                if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert init.end_lineno is not None
    assert init.end_lineno - init.lineno + 1 <= 60


MODEL_KIND_NAMES = ("gpt", "llama", "llama_moe", "moe")
FAMILY_PACKAGES = ("mcpar/models/gpt/", "mcpar/models/llama/", "mcpar/models/moe/")


def _model_kind_tests(path: Path) -> list[str]:
    """Comparisons (==, !=, in, not in) of a model-kind name, alone or in a tuple, list or set,
    with anything (``cfg.kind == "llama"``, ``kind in ("moe", "llama_moe")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(i, ast.Constant) and i.value in MODEL_KIND_NAMES for i in items):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
                break
    return found


def test_model_kinds_are_tested_only_in_their_family_packages() -> None:
    """A consumer that tested ``model.kind`` would not know a registered plug-in family: it
    asks the family's registry entry (``mcpar.registry.model_family``) instead."""
    found = {str(p.relative_to(SRC)): hits for p in SRC.rglob("*.py")
             if not str(p.relative_to(SRC)).startswith(FAMILY_PACKAGES)
             and (hits := _model_kind_tests(p))}
    assert found == {}, found


def test_the_model_kind_ratchet_sees_a_kind_test(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cfg, r):\n    a = cfg.kind == 'gpt'\n"
                     "    b = cfg.kind in ('moe', 'llama_moe')\n    return r['moe'] is None\n")
    assert len(_model_kind_tests(probe)) == 2
