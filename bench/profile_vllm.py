"""Where the vLLM connector's host time per engine step goes (vLLM CPU, bench_vllm's model and workload): the
scheduler side's facts (token truth, block placement, same-step levels) and the worker side's bracket, each timed
around its call. Usage: .venv-vllm/bin/python -m bench.profile_vllm [decode|prefill]."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import kvcanary.integrations.vllm as kv  # noqa: E402
import kvcanary.manager as mg  # noqa: E402

from bench import bench_vllm as B  # noqa: E402
from bench.call_times import time_calls  # noqa: E402

TIMES: dict[str, list[float]] = {}


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "decode"
    for owner, name in ((kv._SchedulerSide, "facts"), (kv._SchedulerSide, "_place_blocks"),
                        (kv._SchedulerSide, "_levels"), (mg.CanaryManager, "begin_forward"),
                        (mg.CanaryManager, "pre_forward"), (mg.CanaryManager, "post_forward"),
                        (mg.CanaryManager, "end_forward")):
        time_calls(owner, name, TIMES)
    with tempfile.TemporaryDirectory() as d:
        path = B.model(d)
        reqs = B.workload(kind, 32 if kind == "decode" else 24)
        B.run(path, {"stats_interval": 0}, reqs)  # warm-up run
        TIMES.clear()
        out = B.run(path, {"stats_interval": 0}, reqs)
    print(kind, {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()})
    for name, ts in TIMES.items():
        print(f"{name:14s} n={len(ts):5d} median {1e6 * statistics.median(ts):8.1f} us  "
              f"mean {1e6 * statistics.mean(ts):8.1f} us")


if __name__ == "__main__":
    main()
