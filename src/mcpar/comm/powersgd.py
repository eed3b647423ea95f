"""PowerSGD: low-rank gradient compression with error feedback and warm start.

Why it is written here and not taken from torch: every collective of the job must go through
the Communicator, which counts the bytes and time per operation, mesh axis and
codec; torch's ``powerSGD_hook`` issues its own ``torch.distributed`` calls from inside DDP's
C++ reducer, which this framework does not use, so its traffic would be invisible to it. (On
gloo that hook also deadlocks with two or more DDP buckets: its future callbacks block gloo's
worker threads waiting on further all-reduces; see bench/emulated_cluster.py.)

Algorithm (docs: algorithms.md §2, Vogels et al. 2019). Each gradient matrix M (error feedback
added) is approximated by a rank-r product P Qᵀ found with one warm-started power-iteration step;
only P (n x r) and Q (m x r) are all-reduced. Vectors and matrices too small to gain are
all-reduced uncompressed, batched into one flat buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from mcpar.comm.communicator import Communicator

POWERSGD_CODEC = "powersgd"


@dataclass
class _MatrixState:
    """PowerSGD state of one compressed gradient: its matrix view, error and warm-started Q."""

    shape: torch.Size
    rows: int
    cols: int
    rank: int
    error: torch.Tensor  # rows x cols, float32, this rank's error feedback
    q: torch.Tensor  # cols x rank, float32, identical on every rank


def _orthogonalize(matrix: torch.Tensor, passes: int = 2) -> None:
    """Gram-Schmidt on the columns of ``matrix`` in place, run twice.

    Plain torch ops (not a LAPACK QR) so that identical inputs give identical outputs on every
    rank. A zero column stays zero instead of becoming NaN (a gradient can be all zero). The
    second pass ("twice is enough") restores orthogonality that one fp32 pass loses when the
    columns are nearly parallel, the usual case for gradients dominated by a few directions;
    without it P Pᵀ is no projection and the approximation error grows (measured: 2.5e-5
    instead of 2.4e-6 on a rank-1-plus-noise 32 x 3 matrix at rank 3). Costs r more column
    operations on an n x r matrix.
    """
    for _ in range(passes):
        for i in range(matrix.shape[1]):
            col = matrix[:, i:i + 1]
            norm = torch.linalg.vector_norm(col)
            col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
            if i + 1 < matrix.shape[1]:
                rest = matrix[:, i + 1:]
                rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))


class SavedGroup(TypedDict):
    """One key's PowerSGD state as ``state_dict`` gives it: the step count, and per compressed
    gradient index its ``error`` and ``q`` matrices."""

    iteration: int
    matrices: dict[int, dict[str, torch.Tensor]]


@dataclass
class _GroupState:
    """PowerSGD state of one list of gradients (one key: the whole model, or one bucket)."""

    iteration: int = 0
    shapes: list[torch.Size] | None = None
    # Per gradient index: its matrix state, or None when it is sent uncompressed.
    matrices: list[_MatrixState | None] | None = None
    # Saved matrices waiting for the first compressed step to learn the shapes.
    pending: dict[int, dict[str, torch.Tensor]] | None = None


class PowerSGDCompressor:
    """Averages gradients over a mesh axis with rank-r PowerSGD compression and error feedback.

    ``reduce(grads, comm, axis, key)`` replaces every gradient in place by the (approximate)
    average over the axis; the result is identical on every rank. Call it once per optimizer
    step for each ``key``, with the same list of gradients (same order and shapes) each time: a
    caller that reduces bucket by bucket passes the bucket index as ``key``, and each key keeps
    its own state and step count.

    - Steps before ``start_iter`` (counting from 0): plain all-reduce average of everything.
    - Afterwards a gradient of shape (n, ...) is viewed as an n x m matrix (m = the rest) and
      compressed when it has >= 2 dimensions and (n + m) * r * min_compression_rate < n * m,
      with r = min(rank, n, m); min_compression_rate 0 compresses every matrix. The others are
      all-reduced uncompressed, flattened into one buffer.
    - Compressed: M = G + e; P = M Q; all-reduce P (mean); orthogonalize P; Q = Mᵀ P;
      all-reduce Q (mean); G <- P Qᵀ; e <- M - P Qᵀ (this rank's M: e also holds the rank's
      deviation from the average, as in torch's hook and the paper's code). All P's travel in
      one all-reduce and all Q's in another (codec "powersgd"): r (n + m) elements per matrix
      instead of n m.
    - Q starts from a normal draw of a generator seeded with ``seed``, the key and the
      gradient's index, so it is the same on every rank, and is warm-started from the previous
      step.
    """

    def __init__(self, rank: int = 2, *, start_iter: int, min_compression_rate: float = 2.0,
                 seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        if min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate}")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self._groups: dict[int, _GroupState] = {}

    def iteration(self, key: int = 0) -> int:
        """Steps reduced so far under ``key``."""
        group = self._groups.get(key)
        return group.iteration if group else 0

    # --- plan ---------------------------------------------------------------------------------
    def _matrix_shape(self, grad: torch.Tensor) -> tuple[int, int, int] | None:
        """(n, m, r) when ``grad`` is worth compressing, else None."""
        if grad.dim() < 2:
            return None
        rows = grad.shape[0]
        cols = grad.numel() // rows
        rank = min(self.rank, rows, cols)
        if (rows + cols) * rank * self.min_compression_rate >= rows * cols:
            return None
        return rows, cols, rank

    def _plan(self, group: _GroupState, key: int,
              grads: list[torch.Tensor]) -> list[_MatrixState | None]:
        shapes = [g.shape for g in grads]
        if group.shapes is None:
            group.shapes = shapes
        elif shapes != group.shapes:
            raise ValueError(f"PowerSGD (key {key}) was given a different list of gradients "
                             "than before")
        if group.matrices is not None:
            return group.matrices
        matrices: list[_MatrixState | None] = []
        for index, grad in enumerate(grads):
            dims = self._matrix_shape(grad)
            if dims is None:
                matrices.append(None)
                continue
            rows, cols, rank = dims
            # Integers only: str hashing is salted per process and would give each rank its own Q.
            gen = torch.Generator().manual_seed(
                ((self.seed * 1_000_003 + key) * 1_000_003 + index) % 2**63)
            q = torch.randn(cols, rank, generator=gen, dtype=torch.float32).to(grad.device)
            error = torch.zeros(rows, cols, dtype=torch.float32, device=grad.device)
            matrices.append(_MatrixState(grad.shape, rows, cols, rank, error, q))
        if group.pending is not None:
            compressed = {i for i, m in enumerate(matrices) if m is not None}
            if set(group.pending) != compressed:
                raise ValueError(f"the saved PowerSGD state of key {key} belongs to a different "
                                 "set of gradients")
            for i, saved in group.pending.items():
                state = matrices[i]
                assert state is not None
                if saved["error"].shape != state.error.shape or saved["q"].shape != state.q.shape:
                    raise ValueError(f"saved PowerSGD state of key {key}, gradient {i}, has "
                                     "another shape")
                state.error.copy_(saved["error"])
                state.q.copy_(saved["q"])
            group.pending = None
        group.matrices = matrices
        return matrices

    # --- reduce -------------------------------------------------------------------------------
    @staticmethod
    def _average_flat(tensors: list[torch.Tensor], comm: Communicator, axis: str,
                      codec: str) -> list[torch.Tensor]:
        """Sum the tensors over the axis in one flat all-reduce and divide by its size."""
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        comm.all_reduce(flat, axis=axis, codec=codec)
        flat.div_(comm.axis_size(axis))
        return [part.view(t.shape) for part, t in
                zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]

    @torch.no_grad()
    def reduce(self, grads: list[torch.Tensor], comm: Communicator,
               axis: str = "dp", key: int = 0) -> None:
        """Replace each gradient in place by its (compressed) average over ``axis``.

        A collective: every rank of the axis calls it with the same keys in the same order.
        """
        if not grads:
            return
        group = self._groups.setdefault(key, _GroupState())
        if group.iteration < self.start_iter:
            for grad, avg in zip(grads, self._average_flat(grads, comm, axis, "none"),
                                 strict=True):
                grad.copy_(avg)
            group.iteration += 1
            return

        states = self._plan(group, key, grads)
        plain = [g for g, s in zip(grads, states, strict=True) if s is None]
        for grad, avg in zip(plain, self._average_flat(plain, comm, axis, "none"), strict=True):
            grad.copy_(avg)

        compressed = [(g, s) for g, s in zip(grads, states, strict=True) if s is not None]
        if compressed:
            matrices = [g.reshape(s.rows, s.cols).to(torch.float32) + s.error
                        for g, s in compressed]
            ps = [m @ s.q for m, (_, s) in zip(matrices, compressed, strict=True)]
            ps = self._average_flat(ps, comm, axis, POWERSGD_CODEC)
            for p in ps:
                _orthogonalize(p)
            qs = [m.t() @ p for m, p in zip(matrices, ps, strict=True)]
            qs = self._average_flat(qs, comm, axis, POWERSGD_CODEC)
            for m, p, q, (grad, state) in zip(matrices, ps, qs, compressed, strict=True):
                approx = p @ q.t()
                torch.sub(m, approx, out=state.error)
                state.q.copy_(q)
                grad.copy_(approx.view(state.shape))
        group.iteration += 1

    # --- inspection and checkpoints --------------------------------------------------------
    def compressed_indices(self, key: int = 0) -> list[int]:
        """Indices of the gradients of ``key`` that are compressed (known after its first
        compressed step)."""
        group = self._groups.get(key)
        return [i for i, m in enumerate((group and group.matrices) or []) if m is not None]

    def error_buffer(self, index: int, key: int = 0) -> torch.Tensor:
        """This rank's error-feedback matrix of gradient ``index`` of ``key`` (rows x cols)."""
        group = self._groups.get(key)
        matrices = (group and group.matrices) or []
        matrix = matrices[index] if index < len(matrices) else None
        if matrix is None:
            raise KeyError(f"gradient {index} of key {key} is not compressed")
        return matrix.error

    def state_dict(self) -> dict[int, SavedGroup]:
        """Per key: step count, and per compressed gradient its error and Q (references to the
        live tensors; the errors differ per rank)."""
        out: dict[int, SavedGroup] = {}
        for key, group in self._groups.items():
            matrices: dict[int, dict[str, torch.Tensor]]
            if group.matrices is not None:
                matrices = {i: {"error": m.error, "q": m.q}
                            for i, m in enumerate(group.matrices) if m is not None}
            else:
                matrices = dict(group.pending or {})
            out[key] = {"iteration": group.iteration, "matrices": matrices}
        return out

    def load_state_dict(self, state: dict[int, SavedGroup]) -> None:
        """Restore from :meth:`state_dict`. The matrices are checked against the gradients and
        copied in at the key's next compressed step (their shapes are known only then)."""
        self._groups = {}
        for key, saved in state.items():
            matrices = saved["matrices"]
            self._groups[int(key)] = _GroupState(
                iteration=int(saved["iteration"]),
                pending={int(i): {k: t.clone() for k, t in m.items()}
                         for i, m in matrices.items()} or None,
            )
