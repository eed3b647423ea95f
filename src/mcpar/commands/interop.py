"""``mcpar export``, ``import`` and ``generate``: parsed in ``mcpar.cli``, their work in
``mcpar.interop`` and ``mcpar.generate``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_interop(args: argparse.Namespace) -> int:
    """``export``, ``import`` and ``generate``: parse here, work in mcpar.interop / generate."""
    if args.command == "export":
        from mcpar.interop.hf_export import export_hf

        print(export_hf(Path(args.run_dir), Path(args.out), args.step,
                        int(args.max_shard_mb * (1 << 20))))
    elif args.command == "import":
        from mcpar.interop.hf_import import section_yaml

        print(section_yaml(Path(args.hf_dir)), end="")
    else:
        from mcpar.generate import Sampling, generate

        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k or None, args.seed)
        text, step = generate(Path(args.run_dir), args.prompt, sampling, args.device, args.step)
        print(f"mcpar generate: step {step} of {args.run_dir}", file=sys.stderr)
        print(text)
    return 0
