"""Probe (GPU machine): torch.profiler over the reference engine's clean run on CUDA, the canary's hooks labeled; what
their host time is made of (ops, launches, copies, syncs: totals and the slowest single ops), and the sweep derive's ops
timed alone on an idle GPU. Usage: python3 gpu/probe_engine_ops.py OUT.txt (eighth session: bench/results/
engine_host_session8/)."""
import statistics
import sys
import time

import kvcanary.engine.canary as ec
import torch
from kvcanary.demo import clean_run
from torch.profiler import ProfilerActivity, profile, record_function

out = sys.argv[1]
dev = torch.device("cuda")
# micro: the derive ops alone, idle GPU, warm allocator
for n in (64, 4096, 65536):
    sl = torch.randint(0, 100000, (n,), device=dev)
    inv = torch.empty(100001, dtype=torch.int64, device=dev)
    for mode in ("default", "warn"):
        torch.cuda.set_sync_debug_mode(mode)
        ts = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            inv.fill_(-1)
            inv.index_copy_(0, sl.clamp(-1, 100000).remainder_(100001), torch.arange(n, dtype=torch.int64, device=dev))
            torch.cumsum(sl.clamp(min=0), 0)
            ts.append(time.perf_counter() - t0)
        torch.cuda.set_sync_debug_mode("default")
        print(f"derive ops n={n} sync_debug={mode}: median {statistics.median(ts)*1e6:.1f} us", flush=True)

for name in ("before_forward", "after_forward", "on_free"):
    hook = getattr(ec.EngineCanary, name)
    def labeled(self, *a, _h=hook, _n=name):
        with record_function(f"canary.{_n}"):
            return _h(self, *a)
    setattr(ec.EngineCanary, name, labeled)
export = getattr(ec.EngineCanary, "_export", None)  # absent before the eighth session


def labeled_export(self, kind):
    with record_function("canary.export"):
        return export(self, kind)


if export is not None:
    ec.EngineCanary._export = labeled_export
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    res = clean_run(0, "cuda", "cuda", 100, quiet=True)
for p in res["phases"]:
    print(p["phase"], p["forwards"], "canary ms/fw", p["canary_ms_per_forward"], "export",
          p.get("export_ms_per_forward"))
hook_ms = {}
for e in prof.events():
    if e.name.startswith("canary.") and e.device_type.name == "CPU":
        hook_ms[e.name] = hook_ms.get(e.name, 0.0) + e.cpu_time_total / 1e3
print("hooks under the profiler, ms per forward:", {k: round(v / 100, 3) for k, v in sorted(hook_ms.items())})
with open(out, "w") as f:
    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
    f.write("\n\n")
    f.write(prof.key_averages(group_by_stack_n=0).table(sort_by="cpu_time_total", row_limit=30))

# inside the canary hooks: totals by op name (self CPU) and the slowest single ops with their runtime children
agg, slow = {}, []
def walk(ev, depth):
    agg.setdefault(ev.name, [0.0, 0])
    agg[ev.name][0] += ev.self_cpu_time_total
    agg[ev.name][1] += 1
    if depth == 1:
        slow.append((ev.cpu_time_total, ev.name, [(c.name, round(c.cpu_time_total, 1)) for c in ev.cpu_children][:6]))
    for c in ev.cpu_children:
        walk(c, depth + 1)
hooks = [e for e in prof.events() if e.name.startswith("canary.") and e.name != "canary.export"]
for h in hooks:
    walk(h, 0)
exp_agg = {}
for e in prof.events():
    if e.name == "canary.export":
        for c in e.cpu_children:
            exp_agg.setdefault(c.name, [0.0, 0])
            exp_agg[c.name][0] += c.cpu_time_total
            exp_agg[c.name][1] += 1
with open(out, "a") as f:
    f.write("\n\ninside canary hooks, self CPU us by op (total, calls):\n")
    for k, (t, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:40]:
        f.write(f"  {t:12.1f} {n:7d}  {k}\n")
    f.write("\ninside the engine's export, cpu total us by direct op (total, calls):\n")
    for k, (t, n) in sorted(exp_agg.items(), key=lambda kv: -kv[1][0])[:25]:
        f.write(f"  {t:12.1f} {n:7d}  {k}\n")
    f.write("\nslowest direct ops of the hooks' callees (cpu total us, name, children):\n")
    for t, n, ch in sorted(slow, key=lambda x: -x[0])[:40]:
        f.write(f"  {t:10.1f} {n} {ch}\n")
