"""``mcpar checkpoint verify RUN [--step N] [--against RUN2 [--against-step M]] [--atol X]``.

Prints the hash of a checkpoint's training state in a canonical order, independent of the
layout it was saved under (``mcpar.interop.canonical_state``), and, with ``--against``, compares
it with another run's checkpoint: equal hashes are the proof that a reshard kept every bit;
otherwise the entries that differ, largest first. Exit 0 when equal (within ``--atol``), 1 when
they differ, 2 for a user error (no such run, no valid checkpoint, incomplete state).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mcpar.errors import UserError, problem

SHOWN_DIFFERENCES = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    verify = sub.add_parser("verify", help="print the layout-independent hash of a checkpoint's "
                            "state; --against compares two")
    verify.add_argument("run_dir", help="run directory of a `mcpar train`")
    verify.add_argument("--step", type=int, default=None, help="default: the newest valid")
    verify.add_argument("--against", default=None, metavar="RUN2",
                        help="another run directory whose checkpoint must hold the same state")
    verify.add_argument("--against-step", type=int, default=None, metavar="M",
                        help="its step (default: the newest valid)")
    verify.add_argument("--atol", type=float, default=0.0,
                        help="largest absolute difference still counted as equal (default 0: "
                        "bit for bit)")


def check_arguments(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.atol) and args.atol >= 0):
        raise UserError(problem("--atol", f"{args.atol}: give a finite value, 0 or more"))
    for flag, step in (("--step", args.step), ("--against-step", args.against_step)):
        if step is not None and step < 0:
            raise UserError(problem(flag, f"{step}: give a step of 0 or more"))
    if args.against_step is not None and args.against is None:
        raise UserError(problem("--against-step", "needs --against RUN2"))


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from mcpar.interop.canonical_state import canonical_state, compare

    check_arguments(args)
    state = canonical_state(Path(args.run_dir), args.step)
    _print_state(state)
    if args.against is None:
        return 0
    other = canonical_state(Path(args.against), args.against_step)
    _print_state(other)
    differences = [d for d in compare(state, other) if not d.max_abs <= args.atol]
    if not differences:
        same = "identical" if state.digest() == other.digest() else f"equal within {args.atol:g}"
        print(f"mcpar checkpoint verify: {same}")
        return 0
    print(f"mcpar checkpoint verify: {len(differences)} entries differ (--atol {args.atol:g}):")
    for d in differences[:SHOWN_DIFFERENCES]:
        print(f"  {d.name}: max |difference| {d.max_abs:.3e}")
    if len(differences) > SHOWN_DIFFERENCES:
        print(f"  ... and {len(differences) - SHOWN_DIFFERENCES} more")
    return 1


def _print_state(state: object) -> None:
    from mcpar.interop.canonical_state import CanonicalState, describe_layout

    assert isinstance(state, CanonicalState)
    print(f"{state.digest()}  {state.path}")
    elements = sum(t.numel() for t in state.tensors.values())
    print(f"  step {state.step}, saved as {describe_layout(state.layout)}; "
          f"{len(state.tensors)} tensors, {elements:,} elements")
    for kind, digest in state.group_digests().items():
        print(f"  {kind:<7} {digest}")
