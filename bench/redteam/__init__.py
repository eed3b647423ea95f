"""The red-team probes of issue 36, split by job; ``bench/redteam_probes.py`` is the command line.

* ``probe``: what a probe is (its folder, its expectation) and the environment a probed command
  runs in;
* ``fixtures``: the inputs built once per suite (a tiny Hugging Face directory, prepared shards,
  a tokenizer, a trained run) and the copies and tmpfs disks each probe crafts from;
* ``hf_probes``, ``argument_probes``, ``disk_probes``: the probes, by family of input;
* ``probes``: the list of every probe with its family and expectation;
* ``runner``: one probe run in a subprocess and what it did wrong;
* ``table``: the per-family counts and the before → after table.

Imported as the package ``redteam`` with ``bench/`` on ``sys.path``, as every bench script imports
its siblings (``bench_workers``).
"""
