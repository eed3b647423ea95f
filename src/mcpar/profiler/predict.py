"""What the plan predicted for this run: the cost model (``mcpar simulate``) on this job's config.

On CUDA the cluster is the hardware table's row for this GPU, at the rates measured on it when
its device profile is valid (``sim.deviceprofile.cuda_cluster``, what ``parallelism.auto``
ranks on too); on CPU it is the machine's saved
local profile when it is this machine's (``sim.profilestore.lookup_profile``; ``mcpar simulate
--cluster local`` measures and saves it, and ``mcpar profile`` before its workers start:
``commands.calibration``). Without one (a worker of torchrun or Slurm, which measure nothing), or
with a stale one (another machine's, or edited), the report says why and how to measure it. A CPU
job that ``parallelism.auto`` priced over several nodes is predicted over the same nodes and link.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mcpar.config import JobConfig
    from mcpar.sim.hardware import NodeLink


def predicted(cfg: JobConfig, world_size: int, device: torch.device,
              nodes: NodeLink | None = None) -> tuple[dict | None, str]:
    """The prediction's figures and where they come from, or None and why not; on CPU over
    ``nodes`` where the job spans several (the nodes ``parallelism.auto`` priced it over)."""
    from mcpar.sim.costmodel import simulate
    from mcpar.sim.deviceprofile import cuda_cluster
    from mcpar.sim.fromconfig import CONFIG_KEYS, config_layout, config_model
    from mcpar.sim.localprofile import local_cluster
    from mcpar.sim.profilestore import lookup_profile

    try:
        if device.type == "cuda":
            cluster, machine = cuda_cluster(world_size)
            source = f"cost model, {machine}"
        else:
            found = lookup_profile()
            if found.profile is None:
                return None, (f"{found.why}: run `mcpar simulate --cluster local CONFIG` once "
                              "to measure this machine")
            cluster = replace(local_cluster(found.profile, nodes=nodes), num_gpus=world_size)
            source = f"cost model, local profile ({found.path})"
            if nodes is not None:
                source += f", {nodes.describe()}"
        precision = {"float32": "fp32", "bfloat16": "bf16"}[cfg.training.dtype]
        layout = config_layout(cfg, world_size, None, precision)
        pred = simulate(config_model(cfg), layout, cluster, where="config", names=CONFIG_KEYS)
    except Exception as err:  # a prediction is a comparison, never a reason to fail the run
        return None, f"the cost model could not price this job ({err})"
    return {"step_s": pred.step_s, "comm_share": pred.comm_fraction,
            "bubble": pred.bubble_fraction, "tokens_per_s": pred.tokens_per_s,
            "mfu": pred.mfu, "memory_bytes": float(pred.memory.total)}, source
