"""The update at each step's end, the step's last task: the gradients clipped over the whole
mesh, the ranks' agreement on skipping a non-finite step, and the optimizer's step, either
synchronized (every rank waits for the step's figures) or post-validated (taken at once and
checked a step later: ``mcpar.post_validation``), and what the loop needs to know of which
steps are settled. A part of the trainer (``Trainer`` inherits it), kept apart from the loop
and the builds.
"""

from __future__ import annotations

import math

from mcpar.device import peak_memory_bytes
from mcpar.errors import TrainingDiverged
from mcpar.parallel.grad_norm import clip_grad_norm, stage_sum_of_squares
from mcpar.parallel.tensor import sync_sequence_parallel_grads
from mcpar.post_validation import Verdict
from mcpar.step_agreement import StepFigures, StepResult, agree_on_step

# What a post-validated update returns when the previous step's check undid the weights its
# step ran on: the step runs again.
RUN_AGAIN = object()


class StepUpdates:
    """The trainer's update methods (their state is the trainer's: see ``Trainer``)."""

    @property
    def post_validation_copy_bytes(self) -> int:
        """The largest copy post-validation held to redo a step (0 without it)."""
        return 0 if self.post_validation is None else self.post_validation.copy_peak_bytes

    def _update(self, step: int, losses: list[float]) -> StepResult | object | None:
        """The step's last task: gradients are complete (and reduced over data); clip them
        over the whole mesh, agree on skipping, and step the optimizer. Under post-validation
        (``_post_validated_update``): None, or ``RUN_AGAIN``."""
        if self.post_validation is not None:
            return self._post_validated_update(step, losses)
        if self.plan.memory.consistency_interval:  # nothing changed the tensors since the last
            self.consistency.before_update(step + 1)  # update: each rank's own checksum
        if self.plan.sequence_parallel:
            sync_sequence_parallel_grads(self.update_params, self.comm)
        grad_norm = clip_grad_norm(self.update_params, self.cfg.optimization.grad_clip,
                                   self.comm, data_sharded=self.plan.memory.data_sharded,
                                   shard_axis=self.plan.memory.shard_axis)
        self.grad_exchange.after_clip()
        local_loss = sum(losses) / len(losses) if losses else None
        nonfinite = not math.isfinite(grad_norm) or (local_loss is not None
                                                     and not math.isfinite(local_loss))
        # One collective over the world before the update, so every rank agrees on skipping
        # (under 1-bit Adam's compressed phase the replicas' gradients differ).
        result = self._gather_step_stats(local_loss, grad_norm, nonfinite)
        self._count_skipped(step, result)
        if result.skipped:
            self.grad_exchange.discard_step()
        else:
            self.optimizer.step()
        if self.moe is not None:
            # Bias balancing and expert migration happen inside the step: their cost is timed.
            result.moe = self.moe.after_step(step)
        if self.plan.memory.consistency_interval:
            self._record_update(step)
        return result

    def _record_update(self, step: int) -> None:
        """After an update: what a test injects there, then each rank's own checksums, the
        reference until the next update."""
        if self.faults is not None:
            self.faults.after_update(step, self.rank, self.pm.params)
        self.consistency.record()

    def _count_skipped(self, step: int, result: StepResult) -> None:
        """Count a step skipped for a non-finite value; too many in a row end the run."""
        if not result.skipped:
            self.nonfinite_in_a_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        limit = self.cfg.training.max_nonfinite_steps
        if self.rank == 0:
            print(f"mcpar: step {step + 1}: non-finite loss or gradients (loss "
                  f"{result.loss}, grad norm {result.grad_norm}); step skipped "
                  f"({self.nonfinite_in_a_row} in a row, limit {limit})", flush=True)
        if self.nonfinite_in_a_row >= limit:
            raise TrainingDiverged(
                f"{limit} steps in a row had non-finite loss or gradients (last: step "
                f"{step + 1}); lower optimization.lr, raise optimization.warmup_steps or "
                "use training.dtype float32, then resume from the last checkpoint")

    # What the loop does after a step (1-based ``done``): one rule each, which the loop and
    # ``_settles`` both read.
    def _evaluates_after(self, done: int) -> bool:
        tr = self.cfg.training
        return done == tr.steps or bool(tr.eval_interval and done % tr.eval_interval == 0)

    def _saves_after(self, done: int) -> bool:
        interval = self.cfg.optimization.checkpoint.interval
        return interval > 0 and done % interval == 0

    def _checks_replicas_after(self, done: int) -> bool:
        every = self.plan.memory.consistency_interval
        return bool(every and done % every == 0)

    def _settles(self, step: int) -> bool:
        """Whether ``step``'s update must wait for its figures under post-validation: the
        loop evaluates, saves, compares the replicas or stops after it, or a stop was asked
        for."""
        done = step + 1
        return (self._stop_seen or done == self.cfg.training.steps or done == self.stop_after
                or self._evaluates_after(done) or self._saves_after(done)
                or self._checks_replicas_after(done))

    def _settled_verdict(self, verdict: Verdict | None) -> None:
        if verdict is not None:
            self._settled.append(verdict)
            self._stop_seen = self._stop_seen or verdict.result.stop_requested
            self._count_skipped(verdict.step, verdict.result)

    def _post_validated_update(self, step: int, losses: list[float]) -> object | None:
        """The update under post-validation (``mcpar.post_validation``): the previous step's
        figures are read first (its update redone where its assumption was wrong: this step
        then returns ``RUN_AGAIN``), then this step's update is taken at once, or settled
        where ``_settles`` says. The loop takes the settled steps from ``_settled``."""
        assert self.post_validation is not None
        checked = self.plan.memory.consistency_interval > 0
        verdict = self.post_validation.settle()
        self._settled_verdict(verdict)
        if verdict is not None and verdict.redo:
            if checked:
                self.consistency.record()  # the redone update is the reference now
            return RUN_AGAIN
        if checked:  # nothing changed the tensors since the last update: own checksums
            self.consistency.before_update(step + 1)
        if self.plan.sequence_parallel:
            sync_sequence_parallel_grads(self.update_params, self.comm)
        norm_sq = float(stage_sum_of_squares(self.update_params, self.comm))
        local_loss = sum(losses) / len(losses) if losses else None
        nonfinite = not math.isfinite(norm_sq) or (local_loss is not None
                                                   and not math.isfinite(local_loss))
        figures = StepFigures(local_loss, 0.0, nonfinite, peak_memory_bytes(self.device),
                              sum(p.numel() for p in self.pm.params),
                              self.recovery.stop_requested, self.compute.grad_wait_start_s())
        self._settled_verdict(self.post_validation.update(step, figures, norm_sq,
                                                          settle=self._settles(step)))
        if checked:
            self._record_update(step)
        return None

    def take_settled(self) -> list[tuple[int, StepResult]]:
        """The steps settled since the last call, oldest first."""
        settled, self._settled = self._settled, []
        return [(v.step, v.result) for v in settled]

    def _gather_step_stats(self, local_loss: float | None, grad_norm: float,
                           nonfinite: bool) -> StepResult:
        """The step's figures agreed over the world in one collective (``agree_on_step``), the
        straggling measured in this rank's gradient-reduction group (the MemoryController's
        shard axis: its replicas)."""
        return agree_on_step(
            self.comm, StepFigures(local_loss, grad_norm, nonfinite,
                                   peak_memory_bytes(self.device),
                                   sum(p.numel() for p in self.pm.params),
                                   self.recovery.stop_requested,
                                   self.compute.grad_wait_start_s()),
            self.comm.group_ranks(self.plan.memory.shard_axis), self.rank)
