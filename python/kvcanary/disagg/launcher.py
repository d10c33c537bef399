"""Spawns the prefill and decode roles on one machine (loopback only), collects their reports, summarizes."""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcanary import _native
from kvcanary.engine.engine import Engine
from kvcanary.errors import CanaryInputError

from .canary import CanaryBinding
from .decode import DecodeRole
from .engines import DecodeEngine, PrefillEngine, Workload, engine_config, model_config
from .errors import PeerLostError, TransferError
from .prefill import PrefillRole
from .transport import Channel, FaultName, FaultSpec, transport_detail

PREFILL_RANK, DECODE_RANK = 0, 1
ROLES = ("prefill", "decode")
TEARDOWN_HUNG = 4  # exit code of a role whose clean process-group teardown did not finish in time
LAUNCHER_GONE = 5  # exit code of a role whose launcher died
DUMP_STACKS = signal.SIGUSR1  # the launcher asks a hung role for every thread's Python stack before killing it


@dataclass(frozen=True)
class LaunchConfig:
    """Everything both roles need; picklable (it crosses the spawn boundary)."""

    device: str = "cpu"
    model: str = "full"
    workload: Workload = field(default_factory=Workload)
    fault: FaultSpec = field(default_factory=FaultSpec)
    canary: bool = True
    backend: str = "auto"
    token_truth: str = "chain"  # off / chain / pool
    layer_coverage: str = "all"  # first / all / sample
    timeout_s: float = 10.0  # a transfer step (payload, ACK)
    idle_timeout_s: float | None = None  # waiting for the next OFFER or a GRANT; None: 6 x timeout_s
    startup_s: float = 120.0  # starting both roles, the workload itself and the reference run (no waits)
    reference: bool = True  # decode side re-runs the workload on one engine and compares outputs
    page_size: int = 1
    start_method: str = "spawn"  # "forkserver" (tests): torch is imported once by the server, not per role

    @property
    def idle_s(self) -> float:
        """How long a role waits for a message its peer may first have to compute (next OFFER, GRANT)."""
        return 6 * self.timeout_s if self.idle_timeout_s is None else self.idle_timeout_s

    @property
    def wait_s(self) -> float:
        """The longest the fault makes a role wait: one idle wait and one step; a silent peer adds a step."""
        extra = self.timeout_s if self.fault.name == FaultName.STALL_DECODE else 0.0
        return self.idle_s + self.timeout_s + extra

    @property
    def bound_s(self) -> float:
        """The launch's stated bound: both roles end within it, or the launcher kills them and reports a hang."""
        return self.startup_s + self.wait_s


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_canary(engine: Engine, cfg: LaunchConfig) -> CanaryBinding | None:
    """Install the canary runtime on a role's engine (None when disabled)."""
    if not cfg.canary:
        return None
    from .runtime_glue import install_on_engine, transfer_config

    return install_on_engine(engine, transfer_config(cfg.backend, cfg.token_truth, cfg.layer_coverage))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _end_with_launcher(pid: int) -> None:
    """The role leaves (exit LAUNCHER_GONE) as soon as the launcher dies, say killed by a script's time limit.

    The launcher, not the parent: a forkserver parent outlives the launcher for as long as its children live.
    """
    def watch() -> None:
        try:
            select.select([os.pidfd_open(pid)], [], [])  # readable once the process has exited
        except (OSError, AttributeError):  # no pidfd here, or the launcher is already gone: poll
            while _alive(pid):
                time.sleep(0.5)
        os._exit(LAUNCHER_GONE)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def stacks_on_signal(path: str) -> None:
    """On DUMP_STACKS, write every thread's Python stack to ``path`` (faulthandler: from the signal handler, so also
    while the main thread is blocked in native code; faulthandler keeps the file open)."""
    faulthandler.register(DUMP_STACKS, file=open(path, "w"), all_threads=True)  # noqa: SIM115


def _role_main(rank: int, cfg: LaunchConfig, port: int, out: str, launcher: int) -> None:
    """Entry point of one spawned role: run it and write its JSON report (an unexpected crash is reported too)."""
    _end_with_launcher(launcher)
    stacks_on_signal(out + ".stacks")
    try:
        report, clean = _run_role(rank, cfg, port)
    except Exception as err:  # report any crash as the role's typed error instead of dying silently
        message = str(err) if isinstance(err, TransferError) else f"{ROLES[rank]}: {str(err).splitlines()[0][:200]}"
        report = {"role": ROLES[rank],
                  "error": {"type": type(err).__name__, "message": message, "detail": traceback.format_exc()}}
        clean = False
    Path(out).write_text(json.dumps(report, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    if not clean:  # a process group with a dead peer or a pending NCCL operation may block in teardown: leave now
        os._exit(0)
    # a clean teardown is bounded too, by the wait allowance a clean run did not use (NCCL's takes about a second)
    guard = threading.Timer(cfg.wait_s, os._exit, (TEARDOWN_HUNG,))
    guard.daemon = True
    guard.start()
    dist.destroy_process_group()
    guard.cancel()


def _run_role(rank: int, cfg: LaunchConfig, port: int) -> tuple[dict[str, Any], bool]:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    gpu = cfg.device == "cuda"
    device = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    if gpu:
        # payload waits poll the NCCL work (transport.py); a watchdog timeout on a payload left pending after a
        # fatal error cleans up the communicator and never kills the role (2 = CleanUpOnly)
        for key, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("NCCL_NVLS_ENABLE", "0")):
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
    # joining may wait for the peer's start (spawn imports torch: seconds on a busy machine); transfer waits have
    # their own limits (Channel), so the group's timeout only bounds the setup and the NCCL watchdog
    timeout = timedelta(seconds=cfg.bound_s)
    try:
        if gpu:
            dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, dist.DistError) as err:  # the peer never joined (or died while joining)
        raise PeerLostError(f"{ROLES[rank]}: join the process group: {ROLES[1 - rank]} never joined",
                            transport_detail(err)) from err
    channel = Channel(1 - rank, control, dist.group.WORLD, cfg.timeout_s, cfg.idle_s, ROLES[rank], ROLES[1 - rank],
                      setup_timeout_s=cfg.startup_s)
    model = model_config(cfg.model)
    requests = cfg.workload.requests(model.vocab_size)
    econf = engine_config(page_size=cfg.page_size)
    if rank == PREFILL_RANK:
        pengine = PrefillEngine(econf, model, device=device)
        rep = PrefillRole(pengine, make_canary(pengine, cfg), channel, cfg.fault).run(requests)
        return rep.to_dict(), rep.error is None
    dengine = DecodeEngine(econf, model, device=device)
    rep = DecodeRole(dengine, make_canary(dengine, cfg), channel, cfg.fault, requests).run()
    report = rep.to_dict()
    if cfg.reference:
        report["reference"] = Engine(econf, model, device=device).generate(requests)
    return report, rep.error is None


def _victims(cfg: LaunchConfig, requests: dict[str, dict[str, Any]]) -> list[str]:
    idx = set(cfg.fault.victims()) if cfg.fault.name in {
        FaultName.CORRUPT, FaultName.TRUNCATE_LAYERS, FaultName.TRUNCATE_TAIL, FaultName.SWAP, FaultName.STALE,
        FaultName.BAD_LENGTH} else set()
    return sorted(rid for rid, e in requests.items() if e.get("index") in idx)


def summarize(cfg: LaunchConfig, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """The launcher's result: outcome per request, detection, transfer overhead, errors of both roles."""
    dreq: dict[str, dict[str, Any]] = decode.get("requests", {})
    victims = _victims(cfg, dreq or prefill.get("requests", {}))
    ref = decode.get("reference") or {}
    outs = decode.get("outputs") or {}
    ok = sorted((rid for rid, e in dreq.items() if e.get("status") == "ok"), key=lambda rid: (len(rid), rid))
    failed = {rid: f"prefill: {e.get('reason')}" for rid, e in prefill.get("requests", {}).items()
              if e.get("status") == "failed"}
    if not dreq:  # the decode role died: what it had received is lost with it
        failed.update({rid: "decode role died" for rid, e in prefill.get("requests", {}).items()
                       if e.get("status") == "sent"})
    failed.update({rid: str(e.get("reason")) for rid, e in dreq.items() if e.get("status") == "failed"})
    kv, canary = int(prefill.get("kv_bytes", 0)), int(prefill.get("canary_bytes", 0))
    by_req: dict[str, list[str]] = {}
    for v in decode.get("violations", []):
        rid = str(v.get("request_id"))
        for reason in v.get("reasons", []):
            key = f"{v['tag']}:{reason}"
            if key not in by_req.setdefault(rid, []):
                by_req[rid].append(key)
    return {
        "device": cfg.device, "model": cfg.model, "requests": cfg.workload.count, "fault": cfg.fault.name.value,
        "fault_target": cfg.fault.target, "victims": victims, "ok": ok, "failed": failed,
        "detected": {rid: by_req.get(rid, []) for rid in victims},
        "violations_by_request": by_req,
        "prefill_violations": len(prefill.get("violations", [])),
        "decode_violations": len(decode.get("violations", [])),
        "outputs_match_reference": (all(outs.get(rid) == ref.get(rid) for rid in ok) if ref else None),
        "errors": {"prefill": prefill.get("error"), "decode": decode.get("error")},
        # a role killed at the bound: its threads' Python stacks when it was killed (where it hung)
        "hang_stacks": {"prefill": prefill.get("hang_stacks"), "decode": decode.get("hang_stacks")},
        "exitcodes": {"prefill": prefill.get("exitcode"), "decode": decode.get("exitcode")},
        "transfers": int(prefill.get("transfers", 0)),
        "overhead": {"kv_bytes": kv, "canary_bytes": canary, "payload_bytes": int(prefill.get("payload_bytes", 0)),
                     "canary_pct_of_kv": round(100.0 * canary / kv, 3) if kv else None,
                     "bytes_per_row": prefill.get("bytes_per_row", {})},
        "faults_fired": decode.get("faults_fired", []),
        "pids": {"prefill": prefill.get("pid"), "decode": decode.get("pid")},
        "wall_s": decode.get("wall_s"), "bound_s": cfg.bound_s,
        "seconds": {"prefill": prefill.get("seconds"), "decode": decode.get("seconds")},
        "config": {"timeout_s": cfg.timeout_s, "idle_timeout_s": cfg.idle_s, "startup_s": cfg.startup_s,
                   "backend": cfg.backend,
                   "canary": cfg.canary, "token_truth": cfg.token_truth,
                   "layer_coverage": cfg.layer_coverage,
                   "workload": asdict(cfg.workload), "page_size": cfg.page_size},
    }


def stacks_of_hung(p: Any, path: str, wait_s: float = 5.0) -> str:
    """Kill a hung role after asking it for every thread's Python stack (faulthandler, even when its main thread is
    blocked in native code); returns what it wrote (empty when it did not answer within ``wait_s``)."""
    os.kill(p.pid, DUMP_STACKS)
    deadline = time.monotonic() + wait_s
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.2)
        new = Path(path).read_text() if os.path.exists(path) else ""
        if new and new == text:  # two equal reads: the dump is complete
            break
        text = new
    p.kill()
    p.join()
    return text


def launch(cfg: LaunchConfig) -> dict[str, Any]:
    """Run both roles to completion (or kill them at ``cfg.bound_s``) and summarize their reports."""
    if cfg.device == "cuda" and torch.cuda.device_count() < 2:
        raise CanaryInputError(f"--device cuda needs 2 GPUs (one per role), found {torch.cuda.device_count()}")
    # build or load the native backend here, before the bound's clock starts: a first JIT build of the module (a fresh
    # checkout, an edited source) takes longer than a role's startup allowance, and both roles would run it at once
    _native.resolve(cfg.backend, torch.device(cfg.device).type)
    ctx = mp.get_context(cfg.start_method)
    if cfg.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "kvcanary.disagg.launcher", "kvcanary.disagg.runtime_glue"])
    port = free_port()
    reports: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvcanary-disagg-") as tmp:
        paths = [os.path.join(tmp, f"role{r}.json") for r in (PREFILL_RANK, DECODE_RANK)]
        procs = [ctx.Process(target=_role_main, args=(r, cfg, port, paths[r], os.getpid()), daemon=True)  # type: ignore[attr-defined]
                 for r in (PREFILL_RANK, DECODE_RANK)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, t0 + cfg.bound_s - time.monotonic()))
        wall = time.monotonic() - t0
        for rank, p in enumerate(procs):
            hung = p.is_alive()
            stacks = stacks_of_hung(p, paths[rank] + ".stacks") if hung else None
            rep: dict[str, Any] = json.loads(Path(paths[rank]).read_text()) if os.path.exists(paths[rank]) else {}
            rep.update(exitcode="hung" if hung else p.exitcode, pid=p.pid, wall_s=round(wall, 3), hang_stacks=stacks)
            reports.append(rep)
    return summarize(cfg, reports[PREFILL_RANK], reports[DECODE_RANK])
