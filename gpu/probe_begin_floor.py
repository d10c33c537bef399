"""Probe: how far the steady begin_forward is above its floor. Per batch size, two managers on the same seeded decode
workload, alternating forwards: one runs the bracket (begin_forward timed), the other only the begin's essential
steps, timed the same way: the held check (one list compare), the live mask, the native ``begin_decode``, the step's
attribution entry and the alarm read. Usage: python3 gpu/probe_begin_floor.py [iters] [batch sizes] [device]."""

import statistics
import sys
import time

import torch
from kvcanary.manager import CanaryManager
from kvcanary.report import StepBatch
from kvcanary.upload import _sources, host_array

from bench.bench_runtime import _gc_off, make_config, warmed

DEV = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda")


def floor(m: CanaryManager, b, step: int) -> None:  # type: ignore[no-untyped-def]
    """The essential steps of a steady begin (no checks beyond the held compare)."""
    up = m.upload
    ids, rows = b.request_ids, b.req_pool_indices_host
    if up.requests.owner[rows].tolist() != ids:
        raise SystemExit("floor: a request does not hold its row")
    live = rows != m.pool.padding_row
    got = up._stage.decode(_sources(b), 0, len(ids), int(b.input_ids.shape[0]),
                           (rows, b.prefix_lens_host, b.extend_lens_host), host_array(b.true_new_tokens), live,
                           up._row_state, up.chains.offset, step, None)
    if got < 0:
        raise SystemExit(f"floor: begin_decode declined the batch ({got})")
    m.reporter.step_batches[step] = StepBatch(ids, 0)
    m.reporter.alarmed()


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for bs in (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,64,256").split(",")):
        (wm, m), (wf, f) = [warmed(bs, 64, iters + 8, DEV, make_config("default", DEV.type, bs, 64)) for _ in range(2)]
        begin, low = [], []
        with _gc_off():
            for i in range(iters):
                b = wm.batch(1)
                t = time.perf_counter()
                m.begin_forward(b)
                begin.append(time.perf_counter() - t)
                m.pre_forward()
                m.post_forward()
                m.end_forward()
                b = wf.batch(1)
                t = time.perf_counter()
                floor(f, b, f.forwards + 1 + i)
                low.append(time.perf_counter() - t)
                if DEV.type == "cuda" and i % 16 == 15:
                    torch.cuda.synchronize()
        med = statistics.median
        print(f"bs {bs}: begin_forward median {1e6 * med(begin):6.2f} us, floor median {1e6 * med(low):6.2f} us",
              flush=True)


if __name__ == "__main__":
    main()
