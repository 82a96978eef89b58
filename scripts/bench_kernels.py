"""The developers' kernel benchmarks, each ours against a baseline, side by side (``scripts/kernel_bench``; its
flags: ``python scripts/bench_kernels.py --help``); ``make perf`` runs them against ``benchmarks/perf/kernels.json``.

    python scripts/bench_kernels.py --kernels postprocess --rows 1024 --output bench-results/postprocess.json
    opsd-rollout compare before.json bench-results/postprocess.json
"""

import sys

from kernel_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
