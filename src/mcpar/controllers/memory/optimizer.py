"""The MemoryController's choice of optimizer: where the AdamW state lives and in what pieces.

Plain AdamW holds a full copy on every rank; under ZeRO it holds this rank's shards (``zero.py``);
when the CommunicationController's gradient exchange is 1-bit, the optimizer is 1-bit Adam,
whose momentum exchange is the compression. With offload, the state of either AdamW lives in
host memory or files and is streamed through the update (``offload.py``; not with 1-bit Adam,
which ``capabilities.py`` refuses).
"""

from __future__ import annotations

import torch

from mcpar.config import JobConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.controllers.communication.plan import CommPlan
from mcpar.controllers.memory.offload import OffloadAdamW, OffloadSpec
from mcpar.controllers.memory.param_store import ParameterStore
from mcpar.controllers.memory.zero import ZeroAdamW
from mcpar.device import adamw_options
from mcpar.optim.onebit_adam import OneBitAdam


def decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: weight decay on matrices only; biases and norms are left
    alone (GPT-2 practice)."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(params: list[torch.nn.Parameter], cfg: JobConfig, zero_stage: int,
                    exchange: CommPlan, comm: CommunicationController,
                    sync: DataParallelGradSync, store: ParameterStore | None = None,
                    offload: OffloadSpec | None = None,
                    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW; or, when the planned gradient exchange is 1-bit, 1-bit Adam (AdamW whose momentum
    is exchanged in 1 bit past its freeze step, through the CommunicationController); or, under
    ZeRO, the MemoryController's AdamW over this rank's shards. Also the parameters whose
    gradients the update reads (ZeRO: the shards' pieces)."""
    opt = cfg.optimization
    if zero_stage > 0:
        zero = ZeroAdamW(sync, comm, zero_stage, lr=opt.lr, betas=(opt.beta1, opt.beta2),
                         weight_decay=opt.weight_decay, store=store, offload=offload)
        return zero, list(zero.pieces)
    groups = decay_groups(params, opt.weight_decay)
    if exchange.strategy == "onebit":
        return OneBitAdam(groups, comm, axis="dp", lr=opt.lr, betas=(opt.beta1, opt.beta2),
                          freeze_step=opt.freeze_step, dp_algorithm=comm.dp_algorithm), params
    if offload is not None:
        return OffloadAdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2),
                            offload=offload), params
    # Fused (one kernel for every parameter) on CUDA, device.adamw_options.
    options = adamw_options(params[0].device) if params else {}
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), **options), params
