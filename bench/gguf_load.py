"""One load of a GGUF file timed, in a process of its own: `python -m npumoe.bench.gguf_load FILE --format int4
[--models DIR]` prints one JSON line: the whole load's seconds (wall and this process's CPU), the experts phase's
(reading, converting and packing every experts module: the time inside CpuExperts.streamed; wall and CPU, the CPU
seconds the steadier figure on a machine other work shares), the conversions
gguf_blocks counted and their seconds, the peak RSS and the file's size. With --models, the load reads and keeps
the quantized store there (a second run converts nothing). bench/results/gguf-load-* were measured with it."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file", type=Path)
    parser.add_argument("--format", choices=("int8", "int4"), required=True)
    parser.add_argument("--models", type=Path, help="the home's models folder (the quantized store's)")
    args = parser.parse_args()

    from npumoe.engine.formats.gguf_blocks import CONVERSIONS, SECONDS
    from npumoe.engine.loading.load import load_model
    from npumoe.engine.moe.cpu_experts import CpuExperts

    experts = [0.0, 0.0]  # wall and CPU seconds (every thread of the process: torch's own too)
    streamed = CpuExperts.streamed.__func__

    def timed(cls, *pieces, **options):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            return streamed(cls, *pieces, **options)
        finally:
            experts[0] += time.perf_counter() - start
            experts[1] += time.process_time() - cpu_start

    CpuExperts.streamed = classmethod(timed)
    load_before = os.getloadavg()
    cpu, wall = time.process_time(), time.perf_counter()
    load_model(args.file, pack=True, format=args.format, dtype="bfloat16", models_dir=args.models)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"file": args.file.name, "file_bytes": args.file.stat().st_size, "format": args.format,
                      "store": str(args.models) if args.models else None, "load_s": round(wall, 2),
                      "load_cpu_s": round(cpu, 2), "experts_s": round(experts[0], 2),
                      "experts_cpu_s": round(experts[1], 2),
                      "conversions": dict(CONVERSIONS), "conversion_s": {k: round(v, 2) for k, v in SECONDS.items()},
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
