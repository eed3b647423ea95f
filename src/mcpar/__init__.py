"""mcpar: Multi-Controller Parallel pre-training of transformers (dense and Mixture-of-Experts)."""

__version__ = "0.1.0"
