"""Starting a job and the environment it runs in.

``env`` (low in the layers: the trainer reads it) tells a worker where it sits under mcpar's own
launcher, torchrun or SLURM; ``local`` is the local multi-process launcher, ``zygote`` forks a
job's workers from one process, ``worker`` is their entry point, ``run_dir`` owns the run
directory (one job at a time, resume safety).
"""
