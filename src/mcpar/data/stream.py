"""Batch streams: seeded, resumable batches over a corpus split.

``BatchStream`` cuts a token array into fixed-length windows and serves them in a seeded order
that depends only on ``(seed, global_batch, tokens, seq_len)``: the sequences of step k are the
same whatever the data-parallel degree or micro-batch size, which is what lets parity tests
compare layouts and lets a run resume on a different layout.
"""

from __future__ import annotations

import numpy as np
import torch

from mcpar.data.shards import PreparedSplit
from mcpar.errors import UserError, problem


class BatchStream:
    """Seeded, layout-independent batches of ``seq_len`` windows over a flat token array.

    Window i is ``tokens[i*L : i*L+L]`` (inputs) and ``tokens[i*L+1 : i*L+L+1]`` (targets). Epoch
    e visits all windows in the order ``np.random.default_rng([seed, e]).permutation(n)``;
    epochs are concatenated into one infinite order, and step k takes positions
    ``[k*G, (k+1)*G)`` of it. ``next_step`` is the resumable position the trainer advances.

    ``tokens`` may instead be a ``PreparedSplit`` (prepared shards, possibly blended): then the
    split maps each position of the same infinite order to a window itself (see
    ``mcpar.data.shards``), in constant memory, and the rank/micro-batch slicing is unchanged.
    """

    def __init__(
        self, tokens: np.ndarray | PreparedSplit, seq_len: int, global_batch: int, seed: int
    ):
        prepared = isinstance(tokens, PreparedSplit)
        if not prepared and tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1 or global_batch < 1 or seed < 0:
            raise ValueError(
                f"need seq_len >= 1, global_batch >= 1, seed >= 0; got {seq_len}, "
                f"{global_batch}, {seed}"
            )
        if prepared:
            tokens.num_sequences(seq_len)  # refuses a source too small for seq_len (exit 2)
        elif len(tokens) < seq_len + 1:
            msg = (
                f"the corpus split has {len(tokens)} tokens, too small for model.seq_len="
                f"{seq_len} (needs {seq_len + 1}); use a larger source or a smaller seq_len"
            )
            raise UserError(problem("data.source", msg))
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.next_step = 0
        # Recent epoch permutations: a step that crosses an epoch boundary needs two at once.
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_sequences(self) -> int:
        if isinstance(self.tokens, PreparedSplit):
            return self.tokens.num_sequences(self.seq_len)
        return (len(self.tokens) - 1) // self.seq_len

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> np.ndarray:
        """The ``global_batch`` window indices of step ``step``, in order (flat arrays only)."""
        if isinstance(self.tokens, PreparedSplit):
            raise TypeError("a prepared split has no flat window indices; use tokens.locate")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, g = self.num_sequences, self.global_batch
        out = np.empty(g, dtype=np.int64)
        filled = 0
        while filled < g:  # more than once only when the step crosses an epoch boundary
            epoch, offset = divmod(step * g + filled, n)
            take = min(g - filled, n - offset)
            out[filled : filled + take] = self._epoch_perm(epoch)[offset : offset + take]
            filled += take
        return out

    def micro_batch(
        self, step: int, dp_rank: int, dp_degree: int, micro_index: int, micro_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64, ``[mbs, seq_len]``) of one rank's micro-batch.

        Rank r owns the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of the step's indices and
        micro-batch j is its j-th block of ``micro_batch_size``, so concatenating every rank's
        micro-batches in order reproduces the single-process batch exactly.
        """
        g = self.global_batch
        if dp_degree < 1 or micro_batch_size < 1 or g % (dp_degree * micro_batch_size):
            raise ValueError(
                f"global_batch {g} is not divisible by data-parallel degree "
                f"{dp_degree} x micro_batch_size {micro_batch_size}"
            )
        per_rank = g // dp_degree
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")
        if not 0 <= micro_index < per_rank // micro_batch_size:
            raise ValueError(
                f"micro_index {micro_index} out of range [0, {per_rank // micro_batch_size})"
            )
        start = dp_rank * per_rank + micro_index * micro_batch_size
        if isinstance(self.tokens, PreparedSplit):
            positions = step * g + start + np.arange(micro_batch_size, dtype=np.int64)
            windows = self.tokens.windows(positions, self.seq_len, self.seed)
        else:
            idx = self.global_indices(step)[start : start + micro_batch_size]
            # One gather of L+1 tokens per window; fancy indexing also works on memmaps.
            offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)
            windows = np.asarray(self.tokens[offsets], dtype=np.int64)
        inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return inputs, targets

    def advance(self) -> None:
        """Mark the current step as consumed."""
        self.next_step += 1

    def state_dict(self) -> dict:
        """The stream position: the next step plus what defines the sample order."""
        return {
            "step": self.next_step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        # The sample order is defined by these three; resuming with others would silently
        # replay or skip data, so refuse instead.
        for key in ("seed", "global_batch", "seq_len"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"data stream state has {key}={state.get(key)!r}, but this "
                    f"stream has {getattr(self, key)!r}"
                )
        self.next_step = int(state["step"])
