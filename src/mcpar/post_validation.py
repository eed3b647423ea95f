"""The optimizer step taken before the mesh agrees on it, and checked one step later: the
post-validation of Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024, section 4).

Why: a step that ends in a collective over the whole pipeline (the global gradient norm for
the clip, the agreement to skip a step with a non-finite value) makes every rank wait there for
the last one, so the next step's first forward leaves the first rank only once the last rank is
done, and every step pays the pipeline's fill again: ``(p - 1)/2`` forwards of ZBV's last rank
at F = B = W, 5.9% of the step at p = 4, m = 8. Here each rank gathers its figures of the step
(its stage's sum of squared gradients, its loss, whether it saw a non-finite value, the run's
other step figures: ``mcpar.step_agreement``) with an asynchronous all-gather and steps its
optimizer at once; the gather is read at the next step's update, by which time every rank has
long joined it. The next step's forwards then meet each rank as soon as it is done: the steps
overlap, and a schedule whose ranks end a step as far apart as they start it loses no fill
(ZBV's orders for it: ``PipelineSchedule.for_overlapped_steps``).

The step taken early assumes what holds for almost every step of a healthy run: every gradient
finite and the global norm under ``optimization.grad_clip`` (a rank that sees a non-finite value
itself skips). Before it, the rank copies its parameters, gradients and optimizer state. When
the figures come in and the assumption was wrong, every rank (they all read the same rows)
puts its copy back and takes the update the synchronized path takes (the gradients scaled by
the clip's coefficient, or no step), and the step that already ran on the undone weights runs
again (``Verdict.redo``). A step the run must see settled (an evaluation, a checkpoint, the
last step, a stop) waits for its figures instead of guessing.

The results equal the synchronized path's: where the clip's coefficient clamps to 1 its
scaling multiplies by one, which changes no value, and the norm is the square root of the same
stage sums, added in pipeline order (at two stages the same float as the synchronized
all-reduce; at more, an all-reduce may add them in another order, a last-bit difference of a
float64 that the clip's test and coefficient would need to sit exactly on to show).

What it costs: a copy of what this rank updates (parameters, gradients and AdamW's two
moments: 16 bytes per fp32 parameter), its copying each step, and a redone step wherever the
assumption fails: each clipped step (often the first few of a run) and each non-finite one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcpar.comm.communicator import CommHandle, Communicator
from mcpar.parallel.grad_norm import clip_with_norm, clips
from mcpar.step_agreement import (
    NORM_SQ_COLUMN,
    StepFigures,
    StepResult,
    agreed_result,
    figures_row,
)


@dataclass
class Verdict:
    """A step's agreed figures, once its update is settled."""

    step: int
    result: StepResult
    # The step was taken on a wrong assumption and redone: the step that ran after it ran on
    # weights now undone and must run again.
    redo: bool = False


@dataclass
class _Snapshot:
    """What one rank's update changes, as it was before the update."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    state: dict[int, dict[str, object]]  # parameter index -> its optimizer state

    @property
    def nbytes(self) -> int:
        tensors = [*self.params, *(g for g in self.grads if g is not None),
                   *(v for s in self.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))]
        return sum(t.untyped_storage().nbytes() for t in tensors)


@dataclass
class _Pending:
    step: int
    rows: torch.Tensor  # every rank's figures row, filled by the gather
    handle: CommHandle
    lrs: list[float]  # the step's learning rate of each parameter group
    snapshot: _Snapshot | None = None
    stepped: bool = False  # this rank took the step on the assumption


class PostValidatedUpdate:
    """One rank's optimizer steps, taken at once and checked a step later (the module's
    text). ``params``: what this rank's optimizer updates; ``grad_group``: this rank's
    gradient-reduction group, whose straggling the result carries."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator, max_norm: float, grad_group: list[int], rank: int):
        self.params, self.optimizer, self.comm = params, optimizer, comm
        self.max_norm, self.grad_group, self.rank = max_norm, grad_group, rank
        self.pipeline_ranks = comm.group_ranks("pp")  # whose stage sums make the norm
        self.pending: _Pending | None = None
        self.redone_steps = 0  # steps whose early update was wrong and was redone
        # The largest copy held (weights, gradients, optimizer state), from an update until the
        # next step settles it: memory the run holds beside its model states.
        self.copy_peak_bytes = 0

    def update(self, step: int, figures: StepFigures, stage_norm_sq: float,
               settle: bool) -> Verdict | None:
        """Start ``step``'s update from this rank's ``figures``. ``settle``: wait for every
        rank's figures and update as the synchronized path does (its verdict); else take the
        step on the assumption (None: ``settle()`` tells later)."""
        assert self.pending is None, "settle() the previous step first"
        row = figures_row(figures, stage_norm_sq)
        flat = torch.empty(self.comm.axis_size("world") * row.numel(), dtype=torch.float64)
        handle = self.comm.all_gather_into_async(flat, row, axis="world")
        rows = flat.view(-1, row.numel())  # filled once the handle is waited on
        pending = _Pending(step, rows, handle, [g["lr"] for g in self.optimizer.param_groups])
        if settle:
            handle.wait()
            result = self._agreed(pending)
            self._apply(result)
            return Verdict(step, result)
        pending.snapshot = self._snapshot()
        self.copy_peak_bytes = max(self.copy_peak_bytes, pending.snapshot.nbytes)
        if not figures.nonfinite:  # a rank that saw one knows the step is skipped
            self.optimizer.step()
            pending.stepped = True
        self.pending = pending
        return None

    def settle(self) -> Verdict | None:
        """The pending step's verdict (None if none is pending): its figures read, and its
        update redone from the copy where the assumption was wrong."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.handle.wait()
        result = self._agreed(pending)
        assumed_right = (not result.skipped and not clips(self.max_norm, result.grad_norm)
                         if pending.stepped else result.skipped)
        if assumed_right:
            return Verdict(pending.step, result)
        assert pending.snapshot is not None
        now = [g["lr"] for g in self.optimizer.param_groups]
        self._restore(pending.snapshot)
        for group, lr in zip(self.optimizer.param_groups, pending.lrs, strict=True):
            group["lr"] = lr
        self._apply(result)
        for group, lr in zip(self.optimizer.param_groups, now, strict=True):
            group["lr"] = lr
        self.redone_steps += 1
        return Verdict(pending.step, result, redo=True)

    # --- the pieces ---------------------------------------------------------------------------
    def _agreed(self, pending: _Pending) -> StepResult:
        """The step's result from every rank's row; the norm from the pipeline's stage sums,
        added in pipeline order."""
        total = torch.zeros(1, dtype=torch.float64)
        for r in self.pipeline_ranks:
            total += pending.rows[r, NORM_SQ_COLUMN]
        norm = float(total.sqrt().squeeze(0))
        return agreed_result(pending.rows, norm, self.grad_group, self.rank)

    def _apply(self, result: StepResult) -> None:
        """The synchronized path's update: none for a skipped step, else the gradients
        clipped to the agreed norm and the optimizer's step."""
        if result.skipped:
            return
        clip_with_norm(self.params, self.max_norm,
                       torch.tensor(result.grad_norm, dtype=torch.float64))
        self.optimizer.step()

    def _snapshot(self) -> _Snapshot:
        state = {}
        for i, p in enumerate(self.params):
            if p in self.optimizer.state:
                state[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in self.optimizer.state[p].items()}
        return _Snapshot([p.detach().clone() for p in self.params],
                         [None if p.grad is None else p.grad.clone() for p in self.params],
                         state)

    @torch.no_grad()
    def _restore(self, snapshot: _Snapshot) -> None:
        for i, p in enumerate(self.params):
            p.copy_(snapshot.params[i])
            grad = snapshot.grads[i]
            if grad is None:
                p.grad = None
            elif p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
            saved = snapshot.state.get(i)
            if saved is None:
                self.optimizer.state.pop(p, None)  # the optimizer had not stepped it yet
                continue
            live = self.optimizer.state[p]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
                    live[k].copy_(v)
                else:
                    live[k] = v
