"""Probe: where the transformers integration's host time per generation step goes (continuous batching, decode steps
of a random Llama): the adapter's batch view, begin_forward, pre_forward, post_forward, end_forward, and inside
end_forward the rolling sweep's slice (_roll: the export, its derive when new, the slice's launches), each timed
around its call (no sync: host time; SYNC=1: the device synchronized before each, untimed, so a part's time is its own
work, not a wait for earlier queued work; NEW=n: n new tokens per request, default 33; DEEP=1: the slice's and the
batch view's own parts, the eager graphs' launches, the move to the compute stream and back, the write check and the
per-layer KV-write hook too; CALLS=1: at
the start of every batch view, one call of each kind a canary step is made of, timed alone inside the step: a Python
call, a tvm-ffi call into the CPU module, and on CUDA a current-device query, an event record, a torch kernel launch
and a tvm-ffi CUDA launch, then all of them once more, so a part's in-step time can be split into calls of each kind,
first and repeated). Each part is reported
separately for the decode steps (the benchmark's) and the mixed ones (prefill chunks).
Usage: [SYNC=1] [NEW=n] [DEEP=1] [CALLS=1] python3 gpu/probe_tf_parts.py [cuda|cpu] [1b|tiny] [batch] [prompt]"""

import os
import statistics
import sys
import time
from collections.abc import Callable

import kvcanary.adapter as ad
import kvcanary.hostcopy as hc
import kvcanary.integrations.transformers as kt
import kvcanary.manager as mg
import kvcanary.ops.slot_rows as sr
import kvcanary.program as pg
import kvcanary.streams as st
import kvcanary.sweep as sw
import kvcanary.upload as up
import torch
from kvcanary import _native

from bench.bench_transformers import LLAMA_1B, LLAMA_TINY, StepTimer, build_model, installed, prompts, run_once
from bench.call_times import time_calls

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = LLAMA_1B if (sys.argv[2] if len(sys.argv) > 2 else "1b") == "1b" else LLAMA_TINY
batch, prompt = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (32, 1024)


class StepParts(dict[str, list[float]]):
    """The parts' times, split by the kind of generation step they ran in: ``decode`` (one new token per request, the
    steps the benchmark times) or ``mixed`` (prefill chunks with them). The batch view, the step's first part, sets the
    kind."""

    kind = "mixed"

    def setdefault(self, name: str, default: list[float] | None = None) -> list[float]:  # type: ignore[override]
        return super().setdefault(f"{name} [{self.kind}]", [] if default is None else default)


times = StepParts()
view = kt.HFPoolAdapter.batch_view


def kind_view(self, io, batch):  # type: ignore[no-untyped-def]
    bv = view(self, io, batch)
    times.kind = "decode" if bv.num_tokens == bv.batch_size else "mixed"
    return bv


kt.HFPoolAdapter.batch_view = kind_view  # type: ignore[method-assign]


def calibration_calls() -> dict[str, Callable[[], object]]:
    """One call of each kind (CALLS=1), on scratch buffers of their own: a slot_rows of no requests through each
    native module (on CUDA with one write slot, so that it launches its fill), and on CUDA torch calls a step makes."""
    def noop() -> None:
        return None

    def native(backend: str) -> Callable[[], object]:
        dev = torch.device(backend)
        table = torch.zeros(1, 1, dtype=torch.int64, device=dev)
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        slots = torch.zeros(1 if backend == "cuda" else 0, dtype=torch.int64, device=dev)
        fn = _native.module(backend).slot_rows
        return lambda: fn(table, none, none, none, none, slots, slots, 1, 1)

    calls: dict[str, Callable[[], object]] = {"cal: python call": noop, "cal: tvm-ffi cpu": native("cpu")}
    if device == "cuda":
        scratch, ev = torch.zeros(1, device="cuda"), torch.cuda.Event()  # type: ignore[no-untyped-call]
        calls |= {"cal: current device": torch.cuda.current_device, "cal: event record": ev.record,
                  "cal: torch launch": scratch.zero_, "cal: tvm-ffi cuda launch": native("cuda")}
    return calls


if os.environ.get("CALLS") == "1":
    calibration = calibration_calls()

    def calibrated_view(self, io, batch):  # type: ignore[no-untyped-def]
        for again in ("", " (again)"):  # the same calls once more: what a call costs once its path is warm
            for name, fn in calibration.items():
                t = time.perf_counter()
                fn()
                times.setdefault(name + again, []).append(time.perf_counter() - t)
        return kind_view(self, io, batch)

    kt.HFPoolAdapter.batch_view = calibrated_view  # type: ignore[method-assign]
sync = torch.cuda.synchronize if os.environ.get("SYNC") == "1" and device == "cuda" else None
for owner, name in ((kt.HFPoolAdapter, "batch_view"), (mg.CanaryManager, "begin_forward"),
                    (mg.CanaryManager, "pre_forward"), (mg.CanaryManager, "post_forward"),
                    (mg.CanaryManager, "end_forward"), (kt.HFPoolAdapter, "_read_slots"), (mg.CanaryManager, "_roll"),
                    (kt.HFPoolAdapter, "prefix_cache_export"), (kt.HFPoolAdapter, "_build_export"),
                    (sw.Sweeper, "roll"), (sw.Sweeper, "_derive")):
    time_calls(owner, name, times, sync)
if os.environ.get("DEEP") == "1":  # inside the slice (export build, derive, launches) and the batch view
    for owner, name in ((kt.HFPoolAdapter, "forget_hashes"), (kt, "export_of_blocks"), (hc, "packed"),
                        (sw, "derive_roll"), (sw, "bind_plan_roll"), (sw.Sweeper, "_verify"),
                        (ad.PrefixCacheExport, "validate"), (kt._Batch, "new_tokens"),
                        (kt, "BatchView"), (up.Upload, "steady"), (ad.BatchView, "check_table"),
                        (torch.cuda.CUDAGraph, "replay"),
                        (mg.CanaryManager, "_expect_sweep"), (kt._Session, "_check_writes")):
        time_calls(owner, name, times)  # type: ignore[arg-type]
    # the batch view's staging (before 12a: StagedRows.put; an A/B may run either), the eager graphs' launches, and
    # the bracket's move to the compute stream and back (before 5bd8553: the handoff's events; after: a switch)
    for owner, name, label in ((getattr(sr, "SlotRowStager", None), "__call__", "stage_slot_rows"),
                               (getattr(hc, "StagedRows", None), "put", "put"),
                               (pg.EagerGraphs, "__call__", "EagerGraphs"),
                               (getattr(st, "StreamHandoff", None), "enter", "handoff enter"),
                               (getattr(st, "StreamHandoff", None), "leave", "handoff leave"),
                               (getattr(st, "StreamSwitch", None), "enter", "switch enter"),
                               (getattr(st, "StreamSwitch", None), "leave", "switch leave")):
        if owner is not None:
            time_calls(owner, name, times, label=label)
    wrap_update = kt._Session._wrap_update

    def timed_wrap_update(self, orig):  # type: ignore[no-untyped-def]
        """The KV-write hook's own time per layer call: the hook's call less transformers' update inside it."""
        inner_s = [0.0]

        def timed_orig(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                inner_s[0] = time.perf_counter() - t

        hook = wrap_update(self, timed_orig)

        def update(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return hook(*a, **k)
            finally:
                times.setdefault("kv-write hook", []).append(time.perf_counter() - t - inner_s[0])
        return update

    kt._Session._wrap_update = timed_wrap_update  # type: ignore[method-assign]

model = build_model(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32)
ps = prompts(batch, prompt, cfg["vocab_size"])
with StepTimer(device) as timer:
    for _rep in range(2):
        times.clear()
        with installed(model, {}) as handle:
            decode, _ = run_once(model, ps, int(os.environ.get("NEW", "33")), timer)
print(f"{device} batch {batch} prompt {prompt}: decode step median {1e3 * statistics.median(decode):.2f} ms, "
      f"bracket host {1e-3 * handle.stats['bracket_us'] / handle.stats['forwards']:.3f} ms per step")
for name, ts in sorted(times.items(), key=lambda kv: kv[0].endswith("[mixed]")):
    med, mean = 1e6 * statistics.median(ts), 1e6 * statistics.mean(ts)
    print(f"  {name:22s} n={len(ts):4d} median {med:8.1f} us  mean {mean:8.1f} us")
