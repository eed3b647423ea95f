"""The global efficiency parameters of the GPU cost model, fitted on published runs.

Reproduce with ``python -m mcpar.sim.calibration --fit`` (it prints this block). The fit
minimizes the squared log error of the predicted step time over ``data/published_runs.csv`` plus
a weak pull of each parameter towards a prior taken from kernel benchmarks (below), because the
11 calibration rows, ten of them one family of runs, cannot pin six parameters alone.

==================  ===========  ============================================================
parameter           prior        where the prior comes from
==================  ===========  ============================================================
gemm                0.80         large fp16/bf16 cuBLAS GEMMs reach 75-90% of dense peak
attention           0.50         FlashAttention-2 causal fwd+bwd, head dim 128: about 50-60%
                                 of A100 peak (FLOPs of the causal half)
memory              0.85         element-wise kernels stream 80-90% of HBM bandwidth
network             0.80         NCCL bus bandwidth is 75-85% of the link rate on DGX systems
overlap             0.90         share of overlappable gradient/weight traffic hidden: DDP,
                                 FSDP and Megatron's overlapped optimizers hide nearly all of it
                                 while compute lasts; NCCL's kernels take some SMs meanwhile
layer_overhead_s    20e-6        launch/sync gaps per layer and micro-batch (about ten
                                 kernels' worth of launch latency)
==================  ===========  ============================================================
"""

from __future__ import annotations

from mcpar.sim.hardware import Efficiency

PRIOR = Efficiency(gemm=0.80, attention=0.50, memory=0.85, network=0.80, overlap=0.90,
                   layer_overhead_s=20e-6)
# How far (in log units, one sigma) each parameter may stray from its prior.
PRIOR_SIGMA = {"gemm": 0.15, "attention": 0.3, "memory": 0.3, "network": 0.3, "overlap": 1.0,
               "layer_overhead_s": 1.5}

# Fitted by `python -m mcpar.sim.calibration --fit` on data/published_runs.csv.
GPU_EFFICIENCY = Efficiency(gemm=0.7149, attention=0.6064, memory=0.6689, network=0.7857,
                            overlap=0.9033, layer_overhead_s=1.666e-05)
