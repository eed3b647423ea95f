"""Hugging Face checkpoints in and out (hf_names, hf_export, hf_import)."""
