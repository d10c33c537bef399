"""The per-forward device program: every op of pre_forward / post_forward bound once per install, at the largest batch,
and run at each forward's bound shape (batch size and new tokens, each rounded up to a power of two)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, TypeVar, cast

import torch
from kvcanary_schema import NUM_LAUNCH_TAGS, Half, LaunchTag, Stage, TokenTruth, WriteCheck

from kvcanary import _native
from kvcanary.adapter import PoolDescription
from kvcanary.config import CanaryConfig
from kvcanary.errors import KVCanaryInternalError
from kvcanary.ops.bookkeep import bind_bookkeep
from kvcanary.ops.bound import BoundOp
from kvcanary.ops.plan import bind_plan_forward
from kvcanary.ops.verify import bind_verify
from kvcanary.ops.write import write_target
from kvcanary.state import CanaryState, GroupState

logger = logging.getLogger("kvcanary")

Op = Callable[[torch.Tensor, int, int], None]  # one step of a stage: takes the forward's slot table, rows and tokens
Shape = tuple[int, int]  # (batch size, new tokens)
K = TypeVar("K")
V = TypeVar("V")


def bucket(n: int, capacity: int) -> int:
    """``n`` rounded up to a power of two, at most ``capacity`` (and never below ``n``; 0 stays 0)."""
    return max(n, min(1 << (n - 1).bit_length(), capacity)) if n > 1 else n


class Lazy(dict[K, V]):
    """A dict whose missing entries are built on first access by ``build(key)`` and kept."""

    def __init__(self, build: Callable[[K], V]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, key: K) -> V:
        got = self[key] = self._build(key)
        return got


# The ops of the program by stage variant, each bound and fused on first use: ("pre", reuse), ("post", reuse) and
# ("graph", True), the post stage for CUDA graph capture (the reuse check always in, the seal on a graph branch beside
# the TAIL write and the reuse check). reuse: the reuse check runs.
Variant = tuple[Literal["pre", "post", "graph"], bool]
Stages = Lazy[Variant, tuple[Op, ...]]


def _end_pool_routing(device: int, pool: tuple[int, int]) -> None:
    """After a failed capture into ``pool``: end torch's routing of allocations to it. A torch without pytorch#180395's
    fix raises capture_end's error before it ends the routing, and its allocator then counts the capture as underway
    for good: the next teardown of any memory pool (a ``torch.cuda.MemPool``, the interpreter's exit) aborts the
    process (``captures_underway.empty()``). A torch that has ended it already says so (RuntimeError), ignored; so is a
    torch whose private binding differs (the cleanup is best effort: the fallback must not fail for it)."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except (RuntimeError, TypeError, AttributeError):
        pass


@contextmanager
def side_branch(side: torch.cuda.Stream) -> Iterator[None]:
    """Launches inside the block go to ``side``, after the current stream's work so far; a captured graph gets them
    as a parallel branch. The caller joins later (``current_stream().wait_stream(side)``)."""
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _forked(side_ops: Sequence[Op], main_ops: Sequence[Op], side: torch.cuda.Stream) -> tuple[Op, ...]:
    """``side_ops`` beside ``main_ops`` (any order is correct: the seal writes HEAD records of new tokens, the TAIL
    write TAIL records, the reuse check reads HEAD records of reused prefixes)."""
    if not side_ops:
        return tuple(main_ops)

    def fork(table: torch.Tensor, rows: int, tokens: int) -> None:
        with side_branch(side):
            run(side_ops, table, (rows, tokens))

    def join(_: torch.Tensor, rows: int, tokens: int) -> None:
        torch.cuda.current_stream(side.device).wait_stream(side)
    return (fork, *main_ops, join)


def _fused(ops: Sequence[Op | BoundOp], backend: str) -> tuple[Op, ...]:
    """Each run of consecutive native bound ops as one native call (``make_sequence``, docs/ops-contract.md 9): the
    host pays one tvm-ffi call per run instead of one per op, and the call cuts the ops' shaped arguments to the
    forward's shape."""
    out: list[Op] = []
    native: list[BoundOp] = []

    def close() -> None:
        if native:
            mod = _native.module("cuda" if backend == "cuda" else "cpu")  # native ops exist on these two only
            seq = mod.make_sequence([op.fn for op in native], [[*op.before, *op.after] for op in native],
                                    [len(op.before) if op.takes_table else -1 for op in native],
                                    [op.shaped_pairs() for op in native])
            out.append(cast(Op, seq))
        native.clear()
    for op in ops:
        if isinstance(op, BoundOp) and op.native:
            native.append(op)
        else:
            close()
            out.append(op)
    close()
    return tuple(out)


class DeviceProgram:
    """Binds (validates once per install) and runs the device parts of the bracket: every stage variant bound at the
    static buffers' full size (the largest batch), each call cutting its batch arguments to the forward's bound
    shape."""

    def __init__(self, state: CanaryState, pool: PoolDescription, config: CanaryConfig, backend: str) -> None:
        self.state, self.pool, self.config, self.backend = state, pool, config, backend
        self._stages: Stages | None = None
        # the last batch's (bs, nt) and its bound shape
        self._last_batch: tuple[int, int] = (-1, -1)
        self._last_shape: Shape = (-1, -1)
        self._checks = (int(WriteCheck.CHAIN_POSITION) if config.chain_position_assert else 0) | \
            (int(WriteCheck.INPUTS) if config.input_asserts else 0)
        # the structural check is a table-space property of the batch: once per forward (HEAD, first group)
        self._structural = int(WriteCheck.STRUCTURAL) if config.structural_check else 0
        self.has_reuse = any(g.reuse_plan is not None for g in state.groups)
        device = state.sink.count.device
        # the graph variant's branch (the seal beside the TAIL ops in a captured graph)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._post_tick = self._bind_tick()
        # eager stages as graph launches: native CUDA ops only (the torch backend's ops may allocate)
        self.graphs = EagerGraphs(device) if backend == "cuda" and config.eager_graphs else None

    def launch(self, ops: tuple[Op, ...], table: torch.Tensor, shape: Shape, eager: bool) -> None:
        """Run one stage of a forward (``eager``: not captured by the engine): from its graph where the program has
        eager graphs (:class:`EagerGraphs`), else op by op."""
        if eager and self.graphs is not None:
            self.graphs(ops, table, shape)
        else:
            run(ops, table, shape)

    def bound_shape(self, bs: int, nt: int) -> Shape:
        """The shape a (bs, nt) batch runs at: each rounded up to a power of two within the capacities, so that an
        engine whose batches vary every forward runs at a handful of shapes (each stage sequence keeps its arguments
        cut per shape). The rows and
        tokens past the batch are padding (``Upload.begin``): a row at the pool's padding row plans nothing, a token
        at out_cache_loc -1 is never written, so the ops' results are those of the batch itself. A pool without a
        padding row (-1) keeps the exact batch size: there a row of -1 is an input error (docs/ops-contract.md 2)."""
        if (bs, nt) != self._last_batch:
            cfg = self.config
            rows = bs if self.pool.padding_row < 0 else bucket(bs, cfg.req_capacity)
            self._last_shape = (rows, bucket(nt, cfg.token_capacity))
            self._last_batch = (bs, nt)
        return self._last_shape

    def stages(self, table: torch.Tensor) -> Stages:
        """The bound ops by stage variant (bound on the first call, with ``table`` standing for the forward's
        tables)."""
        if self._stages is None:
            self._stages = self._bind(table)
        return self._stages

    def _bind(self, table: torch.Tensor) -> Stages:
        """The stages, each variant bound and fused on first use (an eager engine never binds the graph variant, one
        no new request runs at never binds the reuse check)."""
        groups = [self._group_roles(g, gi, table) for gi, g in enumerate(self.state.groups)]

        def role(*names: str, first: tuple[BoundOp, ...] = (), then: tuple[BoundOp, ...] = ()) -> tuple[Op, ...]:
            return _fused([*first, *(op for g in groups for name in names for op in g[name]), *then], self.backend)

        def variant(key: Variant) -> tuple[Op, ...]:
            kind, reuse = key
            if kind == "pre":  # the stage's tick rides in the first group's plan (docs/ops-contract.md 2)
                return role("plan_reuse" if reuse else "plan", "head")
            reuse_verify, last = ("reuse_verify",) if reuse else (), (self._post_tick,)
            if kind == "post":  # eager: one stream
                return role("seal", *reuse_verify, "tail_verify", "tail_write", then=last)
            if self._side is None:
                raise KVCanaryInternalError("the graph variant needs a CUDA device: an invariant of the bracket")
            # captured: the seal beside the TAIL write and the reuse check, after the TAIL verify, whose persistent
            # grid takes every SM (bench_gpu's branch variants: launched beside the TAIL verify, the seal's blocks
            # delayed some of its blocks; the reuse check on the seal's branch lengthened it)
            return (*role("tail_verify"), *_forked(role("seal"), role("tail_write", *reuse_verify, then=last),
                                                   self._side))
        return Lazy(variant)

    def _bind_tick(self) -> BoundOp:
        """The post stage's bookkeeping op, bound once per program: last, advancing the post phase and folding every
        group's plan status into the window's running maximum, and on CUDA mirroring the ring count for the host's
        alarm (Reporter.alarmed). The pre stage's tick (the step the kernels stamp their rows with, and the pre
        phase) is the first plan's (``tick``)."""
        st = self.state
        mirror = (st.sink.count, st.alarm) if st.device.type == "cuda" else (None, None)
        return bind_bookkeep(st.post_tick, st.window_status.view(-1), st.plan_status.view(-1), self.backend,
                             *mirror).frozen()

    def _group_roles(self, g: GroupState, gi: int, table: torch.Tensor) -> Lazy[str, list[BoundOp]]:
        """The ops of one group by role, each bound on first use at the static buffers' full size (frozen native
        calls; their batch arguments are cut to each forward's shape when they run)."""
        st, cfg, nt = self.state, self.config, self.state.input_ids.shape[0]
        page, pad, b = self.pool.table_page, self.pool.padding_row, self.backend
        chain = cfg.token_truth == TokenTruth.CHAIN
        window = self._window(g)
        tick = st.pre_tick if gi == 0 else None  # the pre stage's tick: once, in the first group's plan

        def plan(p: torch.Tensor, s: torch.Tensor, pre: torch.Tensor, ext: torch.Tensor, window: int,
                 truth: bool = False, reuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 tick: torch.Tensor | None = None) -> BoundOp:
            # token truth: the expected chains, and per request the flags of the unknown ones dropped (flag mask)
            return bind_plan_forward(p, s, st.req_pool_indices, pre, ext, table, nt, window=window, padding_row=pad,
                                     expect_prefix=st.expect_prefix if truth else None,
                                     expect_new=st.expect_new if truth else None,
                                     flag_mask=st.flag_mask if truth else None, table_page=page,
                                     reuse=reuse, tick=tick, backend=b).frozen()

        def write(stage: Stage) -> BoundOp:
            checks = self._checks | (self._structural if stage == Stage.HEAD and gi == 0 else 0)
            if g.write_carries is not None:  # the pre stage's HEAD write keeps its scan for the TAIL write
                checks |= int(WriteCheck.RECORD_CARRIES if stage == Stage.HEAD else WriteCheck.REUSE_CARRIES)
            fp = g.fingerprint if stage == Stage.TAIL else g.seal
            target = write_target(g.views(stage), stage, g.status, table, st.sink, checks=checks,
                                  token_pool=st.token_pool, fingerprint=fp, table_page=page,
                                  workspace=g.write_workspaces[stage == Stage.TAIL], carries=g.write_carries,
                                  backend=b)
            return target.bind(g.plan, st.input_ids, st.positions, st.out_cache_loc).frozen()

        def stripe() -> list[BoundOp]:
            if g.stripe_plan is None or g.stripe_status is None:
                return []
            return [plan(g.stripe_plan, g.stripe_status, st.stripe_end, st.zeros, cfg.stripe_size)]

        def build(name: str) -> list[BoundOp]:
            if name == "plan":
                return [plan(g.plan, g.status, st.prefix_lens, st.extend_lens, window, chain, tick=tick),
                        *stripe()]
            if name == "plan_reuse":  # [0, reuse_end): the whole reused prefix, planned in the main plan's launch
                if g.reuse_plan is None or g.reuse_status is None:
                    return roles["plan"]
                return [plan(g.plan, g.status, st.prefix_lens, st.extend_lens, window, chain,
                             (g.reuse_plan, g.reuse_status, st.reuse_end), tick), *stripe()]
            if name == "seal":
                return [write(Stage.HEAD)] if g.seal is not None else []
            if name == "tail_write":
                return [write(Stage.TAIL)]
            if name == "head":
                return [*self._verifies(g, name, table), *([write(Stage.HEAD)] if g.seal is None else [])]
            return self._verifies(g, name, table)  # tail_verify, reuse_verify
        roles: Lazy[str, list[BoundOp]] = Lazy(build)
        return roles

    def _window(self, g: GroupState) -> int:
        """The forward plan's window: WINDOW coverage, the newest links; an SWA group, its window; else 0, every
        link."""
        return g.window if g.stripe_plan is None else self.config.window_links

    def _verifies(self, g: GroupState, role: str, table: torch.Tensor) -> list[BoundOp]:
        """The verify ops of group ``g``'s ``role`` (head, tail_verify, reuse_verify)."""
        st, cfg, page, b = self.state, self.config, self.pool.table_page, self.backend
        if role == "reuse_verify":
            if g.reuse_plan is None or g.reuse_status is None:
                return []
            return [bind_verify(g.head, Stage.TAIL, g.reuse_plan, g.reuse_status, table, st.sink,
                                fingerprint=g.seal, table_page=page, backend=b).frozen()]
        stage = Stage.HEAD if role == "head" else Stage.TAIL
        fp = g.fingerprint if stage == Stage.TAIL else None
        window = self._window(g)
        # (plan, status, its window: the most entries a segment holds, 0 = a whole prefix); the CUDA verify's grid
        # comes from the plan's rows times that
        plans = [(g.plan, g.status, window)] + (
            [(g.stripe_plan, g.stripe_status, cfg.stripe_size)]
            if g.stripe_plan is not None and g.stripe_status is not None else [])
        return [bind_verify(g.views(stage), stage, p, s, table, st.sink, token_pool=st.token_pool, fingerprint=fp,
                            table_page=page, max_segment_entries=w, backend=b).frozen() for p, s, w in plans]

    def launches(self, reuse: bool) -> torch.Tensor:
        """[NUM_LAUNCH_TAGS, 2]: (verify, write) launches one forward makes per tag (with or without the reuse
        check)."""
        out = torch.zeros(NUM_LAUNCH_TAGS, 2, dtype=torch.int64)
        for g in self.state.groups:
            verifies = 2 if g.stripe_plan is not None else 1
            for stage in (Stage.HEAD, Stage.TAIL):
                extra = int(reuse and stage == Stage.TAIL and g.reuse_plan is not None)
                for h in range(g.spec.halves):
                    out[int(LaunchTag.of(stage, Half(h), g.spec.group))] += torch.tensor([verifies + extra, 1])
        return out


def run(ops: Sequence[Op], table: torch.Tensor, shape: Shape) -> None:
    """Run one stage's ops on the forward's slot table at its bound ``shape``."""
    rows, tokens = shape
    for op in ops:
        op(table, rows, tokens)


# (the stage's ops by identity, bound shape, slot table address, its shape and dtype): what a captured graph froze
GraphKey = tuple[int, Shape, int, tuple[int, ...], torch.dtype]


CAPTURE_AFTER = 16  # EagerGraphs: the run of a (stage, shape, slot table) that captures it


class EagerGraphs:
    """The eager stages on CUDA as one graph launch each. A stage's native sequence launches its kernels one by one
    (about 4 µs of host time each); captured once, the same kernels with the same arguments run from one graph launch.
    A (stage, shape, slot table) is captured the ``capture_after``-th time it runs and launched from its graph from
    then on; at most ``max_graphs`` are kept, later ones run directly. A launch from the graph saved 14-23 µs of host
    time per eager forward on an H100, and a capture costs up to about 0.8 ms once (bench/results/host_session17), so
    only shapes that recur are captured: an engine's steady decode shapes, not each prefill's. The graph freezes the
    kernels' arguments: the static buffers (fixed for the install) and the table's address, shape and dtype (the key),
    so a graph never runs with another table. A capture that fails turns the graphs off for this program (logged
    once): the stages then run directly, as with ``CanaryConfig(eager_graphs=False)``."""

    def __init__(self, device: torch.device, capture_after: int = CAPTURE_AFTER, max_graphs: int = 64) -> None:
        self.enabled = True
        self.capture_after, self.max_graphs = capture_after, max_graphs
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._seen: dict[GraphKey, int] = {}
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # a graph launches on the current device's stream: launched only while this one is current
        self._device = torch.cuda.current_device() if device.index is None else device.index
        self._pool = torch.cuda.graph_pool_handle()  # one (empty: the stages allocate nothing) pool for all

    def __call__(self, ops: tuple[Op, ...], table: torch.Tensor, shape: Shape) -> None:
        """Run the stage ``ops`` (bound and kept for the program's life, so their identity names them). Inside another
        capture (an engine capturing a forward it declared eager) the ops run directly and join that graph, as they
        would without graphs: no graph is launched or captured there. So they do while another device is current
        (the direct launches go to the table's device, a graph launch to the current device's stream)."""
        # torch.cuda's own wrappers of these two add microseconds per call (CUDA is initialized: the table is there)
        if torch._C._cuda_getDevice() != self._device or torch._C._cuda_isCurrentStreamCapturing():
            run(ops, table, shape)
            return
        key = (id(ops), shape, table.data_ptr(), tuple(table.shape), table.dtype)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, ops, table, shape) if self.enabled else None
            if g is None:
                run(ops, table, shape)
                return
        g.replay()

    def _capture(self, key: GraphKey, ops: tuple[Op, ...], table: torch.Tensor, shape: Shape
                 ) -> torch.cuda.CUDAGraph | None:
        """The stage's graph once ``key`` is due and there is room, else None (the caller runs it directly)."""
        if len(self.graphs) >= self.max_graphs:
            return None
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen < self.capture_after:
            if len(self._seen) > 4 * self.max_graphs:  # keys seen once (tables, shapes) do not pile up
                self._seen.clear()
            return None
        g = torch.cuda.CUDAGraph()
        try:
            # thread-local: the engine's other threads may use CUDA meanwhile; capturing runs nothing
            with torch.cuda.stream(self._stream):
                g.capture_begin(self._pool, capture_error_mode="thread_local")
                try:
                    run(ops, table, shape)
                finally:
                    g.capture_end()
        except RuntimeError as err:
            _end_pool_routing(self._device, self._pool)
            self.enabled = False
            logger.warning("kvcanary: capturing an eager stage failed (%s); its stages run without graphs", err)
            return None
        self.graphs[key] = g
        return g
