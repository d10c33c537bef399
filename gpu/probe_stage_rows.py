"""Probe: host µs of the transformers batch view's staging call (``stage_slot_rows``, docs/ops-contract.md 12a) on CUDA,
split into its pieces: the bound stager, the native call without its event, with no requests, the fill alone
(``slot_rows`` on device facts), the facts' conversion, and the path it replaced (a torch copy of pinned rows and an
event, then ``slot_rows``). A batch of at most STAGE_INLINE_ROWS requests passes its facts in the fill's launch (no
event, no copy); a larger one is copied from the pinned staging. The calls run round-robin, so that each sees the same
host state.
Usage: python3 gpu/probe_stage_rows.py [iters] [batch size, default 32] [positions per request, default 1064]."""

import statistics
import sys
from collections.abc import Callable

import numpy as np
import torch
import tvm_ffi
from kvcanary import _native
from kvcanary.ops.slot_rows import SlotRowStager

from bench.call_times import round_robin


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    bs = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    per = int(sys.argv[3]) if len(sys.argv) > 3 else 1064
    dev = torch.device("cuda", 0)
    rows, pre, ext = list(range(bs)), [per - 1] * bs, [1] * bs
    table = torch.full((max(bs, 1) * 2, per + 64), -1, dtype=torch.int32, device=dev)
    stager = SlotRowStager(table, 4096 * 3, 4096, 2 * max(bs, 1), "cuda")
    src = torch.arange(bs * per, dtype=torch.int64, device=dev)
    write, out = src[:bs].clone(), torch.empty(bs, dtype=torch.int64, device=dev)
    facts = np.array((rows, pre, ext), dtype=np.int64)
    empty = np.zeros((3, 0), dtype=np.int64)
    mod = _native.module("cuda")
    tbl, staging, dfacts = (tvm_ffi.from_dlpack(t) for t in (table, stager.staging, stager.facts))
    dev_facts = stager.facts
    starts = torch.arange(0, bs * per, per, dtype=torch.int64, device=dev)
    kv = torch.full((bs,), per, dtype=torch.int64, device=dev)
    pinned = torch.zeros((5, 2 * max(bs, 1)), dtype=torch.int64, pin_memory=True)
    host, dst = pinned.numpy(), torch.zeros_like(pinned, device=dev)
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    stream = torch.cuda.current_stream()

    def before() -> None:  # the replaced path: StagedRows.put (pinned write, copy, event), then slot_rows
        ev.synchronize()
        host[:3, :bs] = (rows, pre, ext)
        dst.copy_(pinned, non_blocking=True)
        ev.record(stream)
        mod.slot_rows(tbl, dst[0, :bs], dst[4, :bs], dst[3, :bs], src, out, write, 4096 * 3, 4096)

    calls: dict[str, Callable[[], object]] = {
        "stager call": lambda: stager(facts, src, out, write),
        "native, event 0": lambda: mod.stage_slot_rows(tbl, facts, staging, dfacts, src, out, write, 4096 * 3, 4096,
                                                       0),
        "native, no requests": lambda: mod.stage_slot_rows(tbl, empty, staging, dfacts, src, out, write,
                                                                     4096 * 3, 4096, 0),
        "slot_rows alone (device facts)": lambda: mod.slot_rows(tbl, dev_facts[0, :bs], starts, kv, src, out, write,
                                                                4096 * 3, 4096),
        "np.array of the facts": lambda: np.array((rows, pre, ext), dtype=np.int64),
        "before: put + slot_rows": before,
    }
    times = round_robin(calls, n, lambda i: torch.cuda.synchronize() if i % 16 == 15 else None)
    torch.cuda.synchronize()
    print(f"bs {bs}, {per} positions per request, {n} rounds")
    for name, ts in times.items():
        print(f"  {name:32s} median {1e6 * statistics.median(ts):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
