"""Models, plugged in through a small spec (see spec.py)."""
