"""Parallelism mechanisms the controllers use: data, tensor, pipeline, expert."""
