"""What the devices' kernels keep for the backward pass where CPU and CUDA differ: the facts
the memory model prices, without importing torch (``device.py`` holds the rest of what differs
between the devices, and needs torch).

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


def run_device_type(requested: str) -> str:
    """'cpu' or 'cuda' for ``training.device``: the choice ``select_device`` makes when the run
    starts (for 'auto', torch is asked only where CUDA is possible)."""
    if requested in ("cpu", "cuda"):
        return requested
    return "cuda" if cuda_available() else "cpu"
