"""What the devices' kernels and point-to-point backends keep where CPU and CUDA differ: the
facts the memory model prices and the runtime follows, without importing torch (``device.py``
holds the rest of what differs between the devices, and needs torch).

Both were read off the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``
around one attention block, torch 2.13, CPU):

- **attention under dropout.** CUDA's flash and memory-efficient kernels apply attention dropout
  inside the kernel. CPU's flash kernel has no dropout: ``scaled_dot_product_attention`` with
  ``dropout_p > 0`` falls back to its math composite, which keeps three fp32 tensors of
  batch x heads x s x s (the softmax output, the dropout's scaled mask, the dropped
  probabilities) and fp32 copies of Q x sqrt(scale), K x sqrt(scale) and V, in fp32 even when
  Q, K and V are bfloat16, and no longer keeps Q, K and V themselves;
- **dropout masks.** ``nn.Dropout`` runs torch's fused ``native_dropout`` only on CUDA, which
  keeps a 1-byte mask; on CPU it multiplies by a noise tensor of the input's dtype and keeps it.

And one the pipeline executor follows (``pipeline_receives_ahead``), measured with
``bench/pipeline_bubble.py``'s fixed-cost stages (4 gloo processes, p 4, m 8, 2 cores):

- **receives posted ahead.** gloo moves a point-to-point message only once both ends are posted:
  a receive posted when its task comes round (the message long sent) costs a round trip of both
  processes' wake-ups, 0.7-1.0 ms per receive there (median), against 0.2-0.4 ms for one posted
  earlier, whose bytes land while the rank computes. On NCCL a posted receive is a kernel on the
  pair's stream, and a send to the same peer queues behind it: two neighbours that each post a
  receive ahead and then send would wait for each other. So only gloo posts ahead.
"""

from __future__ import annotations

from mcpar.device_select import cuda_available

# The math attention keeps its scores and its copies of Q, K and V in fp32 (bytes per element).
MATH_ATTENTION_BYTES = 4
# The scores it keeps per query-key pair: softmax output, scaled dropout mask, dropped output.
MATH_ATTENTION_SCORE_TENSORS = 3


def attention_kernel(device: str, dropout: bool) -> str:
    """The attention kernel ``scaled_dot_product_attention`` runs on `device` ('cpu' | 'cuda'):
    'math' for CPU under dropout, else 'flash'."""
    return "math" if device == "cpu" and dropout else "flash"


def dropout_mask_bytes(device: str, value_bytes: float) -> float:
    """Bytes per element of the mask a dropout keeps over values of `value_bytes` each."""
    return value_bytes if device == "cpu" else 1.0


# Receives a pipeline rank keeps posted per peer on gloo: the next message's, and one more for a
# peer that sends twice in a row (a V's neighbour sends forwards and backwards).
GLOO_RECEIVES_AHEAD = 2


def pipeline_receives_ahead(device: str) -> int:
    """Receives a pipeline rank keeps posted per sending peer on `device` ('cpu' | 'cuda')
    before their tasks come round: ``GLOO_RECEIVES_AHEAD`` on CPU (gloo), none on CUDA (NCCL)."""
    return GLOO_RECEIVES_AHEAD if device == "cpu" else 0


def run_device_type(requested: str) -> str:
    """'cpu' or 'cuda' for ``training.device``: the choice ``select_device`` makes when the run
    starts (for 'auto', torch is asked only where CUDA is possible)."""
    if requested in ("cpu", "cuda"):
        return requested
    return "cuda" if cuda_available() else "cpu"
