"""The per-forward device program: every op of pre_forward / post_forward bound once per bound shape (batch size and
new tokens, each rounded up to a power of two)."""

from __future__ import annotations

from collections import OrderedDict
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
from kvcanary.ops.write import WriteTarget, write_target
from kvcanary.state import CanaryState, GroupState

Op = Callable[[torch.Tensor], None]  # one step of a stage: takes the forward's slot table
Shape = tuple[int, int]  # (batch size, new tokens)
K = TypeVar("K")
V = TypeVar("V")


def bucket(n: int, capacity: int) -> int:
    """``n`` rounded up to a power of two, at most ``capacity`` (and never below ``n``; 0 stays 0)."""
    return max(n, min(1 << (n - 1).bit_length(), capacity)) if n > 1 else n


def memo(cache: dict[K, V], key: K, build: Callable[[], V]) -> V:
    """``cache[key]``, built by ``build()`` and kept on a miss."""
    got = cache.get(key)
    if got is None:
        got = cache[key] = build()
    return got


class Lazy(dict[K, V]):
    """A dict whose missing entries are built on first access by ``build(key)`` and kept."""

    def __init__(self, build: Callable[[K], V]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, key: K) -> V:
        got = self[key] = self._build(key)
        return got


# The ops of one bound shape by stage variant, each fused on first use: ("pre", reuse), ("post", reuse) and
# ("graph", True), the post stage for CUDA graph capture (the reuse check always in, the seal on a graph branch beside
# the TAIL write and the reuse check). reuse: the reuse check runs.
Variant = tuple[Literal["pre", "post", "graph"], bool]
Stages = Lazy[Variant, tuple[Op, ...]]


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

    def fork(table: torch.Tensor) -> None:
        with side_branch(side):
            run(side_ops, table)

    def join(_: torch.Tensor) -> None:
        torch.cuda.current_stream(side.device).wait_stream(side)
    return (fork, *main_ops, join)


def _fused(ops: Sequence[Op], backend: str) -> tuple[Op, ...]:
    """Each run of consecutive native bound ops as one native call (``make_sequence``, docs/ops-contract.md 9): the
    host pays one tvm-ffi call per run instead of one per op."""
    out: list[Op] = []
    native: list[BoundOp] = []

    def close() -> None:
        if len(native) > 1:
            fns = [op.fn for op in native]
            mod = _native.module("cuda" if backend == "cuda" else "cpu")  # native ops exist on these two only
            seq = mod.make_sequence(fns, [[*op.before, *op.after] for op in native],
                                    [len(op.before) if op.takes_table else -1 for op in native])
            out.append(cast(Op, seq))
        else:
            out.extend(native)
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
    """Binds (validates once) and runs the device parts of the bracket; shapes cached in a bounded LRU, captured
    shapes pinned."""

    def __init__(self, state: CanaryState, pool: PoolDescription, config: CanaryConfig, backend: str,
                 capacity: int = 16) -> None:
        self.state, self.pool, self.config, self.backend = state, pool, config, backend
        self.capacity = capacity
        self.pinned: set[Shape] = set()
        self._cache: OrderedDict[Shape, Stages] = OrderedDict()
        # the last batch's (bs, nt), its bound shape and that shape's stages (kept while the shape repeats; an entry
        # the LRU evicts meanwhile stays valid: bound ops hold everything they use)
        self._last_batch: tuple[int, int] = (-1, -1)
        self._last_shape: Shape = (-1, -1)
        self._last_stages: Stages | None = None
        self._checks = (int(WriteCheck.CHAIN_POSITION) if config.chain_position_assert else 0) | \
            (int(WriteCheck.INPUTS) if config.input_asserts else 0)
        # the structural check is a table-space property of the batch: once per forward (HEAD, first group)
        self._structural = int(WriteCheck.STRUCTURAL) if config.structural_check else 0
        self.has_reuse = any(g.reuse_plan is not None for g in state.groups)
        device = state.sink.count.device
        # the graph variant's branch (the seal beside the TAIL ops in a captured graph)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._ticks = (self._bind_tick(False), self._bind_tick(True))
        # (group, plan rows, role) -> the verify ops every shape of those rows shares (a handful of row buckets);
        # (group, stage) -> the part of its write every shape shares
        self._verify_ops: dict[tuple[int, int, str], list[Op]] = {}
        self._write_targets: dict[tuple[int, Stage], WriteTarget] = {}

    def bound_shape(self, bs: int, nt: int) -> Shape:
        """The shape a (bs, nt) batch runs at: each rounded up to a power of two within the capacities, so that an
        engine whose batches vary every forward binds a handful of shapes instead of one per batch. The rows and
        tokens past the batch are padding (``Upload.begin``): a row at the pool's padding row plans nothing, a token
        at out_cache_loc -1 is never written, so the ops' results are those of the batch itself. A pool without a
        padding row (-1) keeps the exact batch size: there a row of -1 is an input error (docs/ops-contract.md 2)."""
        if (bs, nt) != self._last_batch:
            cfg = self.config
            rows = bs if self.pool.padding_row < 0 else bucket(bs, cfg.req_capacity)
            shape = (rows, bucket(nt, cfg.token_capacity))
            if shape != self._last_shape:
                self._last_shape, self._last_stages = shape, None
            self._last_batch = (bs, nt)
        return self._last_shape

    def stages(self, shape: Shape, table: torch.Tensor) -> Stages:
        """The bound ops of ``shape`` (bound now on a miss, with ``table`` standing for the forward's tables)."""
        if shape == self._last_shape and self._last_stages is not None:  # the common case: as the last forward
            return self._last_stages
        got = self._cache.get(shape)
        if got is None:
            got = self._cache[shape] = self._bind(shape, table)
            self._evict()
        else:
            self._cache.move_to_end(shape)
        if shape == self._last_shape:
            self._last_stages = got
        return got

    def _evict(self) -> None:
        for shape in list(self._cache):
            if len(self._cache) <= self.capacity + len(self.pinned):
                return
            if shape not in self.pinned:
                del self._cache[shape]

    def _bind(self, shape: Shape, table: torch.Tensor) -> Stages:
        """The stages of ``shape``, each variant bound and fused on first use (an eager engine never binds the graph
        variant, a shape no new request runs at never binds the reuse check)."""
        groups = [self._group_roles(g, gi, shape, table) for gi, g in enumerate(self.state.groups)]

        def role(*names: str, first: tuple[Op, ...] = (), then: tuple[Op, ...] = ()) -> tuple[Op, ...]:
            return _fused([*first, *(op for g in groups for name in names for op in g[name]), *then], self.backend)

        def variant(key: Variant) -> tuple[Op, ...]:
            kind, reuse = key
            if kind == "pre":
                return role("plan_reuse" if reuse else "plan", "head", first=(self._ticks[0],))
            reuse_verify, last = ("reuse_verify",) if reuse else (), (self._ticks[1],)
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

    def _bind_tick(self, post: bool) -> Op:
        """The bookkeeping op, bound once per program. pre: first (the step the kernels stamp their rows with);
        post: last, folding every group's plan status into the window's running maximum, and on CUDA mirroring the
        ring count for the host's alarm (Reporter.alarmed)."""
        st = self.state
        none = st.zeros[:0]
        mirror = (st.sink.count, st.alarm) if post and st.device.type == "cuda" else (None, None)
        fold = (st.window_status.view(-1), st.plan_status.view(-1)) if post else (none, none)
        counters = st.post_tick if post else st.pre_tick
        return bind_bookkeep(counters, *fold, self.backend, *mirror).frozen()

    def _group_roles(self, g: GroupState, gi: int, shape: Shape, table: torch.Tensor) -> Lazy[str, list[Op]]:
        """The ops of one group at ``shape`` by role, each bound on first use (frozen native calls)."""
        st, cfg, (bs, nt) = self.state, self.config, shape
        page, pad, b = self.pool.table_page, self.pool.padding_row, self.backend
        chain = cfg.token_truth == TokenTruth.CHAIN
        rpi, zeros = st.req_pool_indices[:bs], st.zeros[:bs]
        rows = max(bs, 1)  # plans sized to the batch (a request plans at most one segment)
        fwd_plan = g.plan[:rows]
        window = self._window(g)

        def plan(p: torch.Tensor, s: torch.Tensor, pre: torch.Tensor, ext: torch.Tensor, window: int,
                 truth: bool = False, reuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Op:
            # token truth: the expected chains, and per request the flags of the unknown ones dropped (flag mask)
            return bind_plan_forward(p, s, rpi, pre, ext, table, nt, window=window, padding_row=pad,
                                     expect_prefix=st.expect_prefix[:bs] if truth else None,
                                     expect_new=st.expect_new[:bs] if truth else None,
                                     flag_mask=st.flag_mask[:bs] if truth else None, table_page=page,
                                     reuse=reuse, backend=b).frozen()

        def write(stage: Stage) -> Op:
            target = memo(self._write_targets, (gi, stage), lambda: self._write_target(g, gi, stage, table))
            return target.bind(fwd_plan, st.input_ids[:nt], st.positions[:nt], st.out_cache_loc[:nt]).frozen()

        def stripe() -> list[Op]:
            if g.stripe_plan is None or g.stripe_status is None:
                return []
            return [plan(g.stripe_plan[:rows], g.stripe_status, st.stripe_end[:bs], zeros, cfg.stripe_size)]

        def build(name: str) -> list[Op]:
            if name == "plan":
                return [plan(fwd_plan, g.status, st.prefix_lens[:bs], st.extend_lens[:bs], window, chain), *stripe()]
            if name == "plan_reuse":  # [0, reuse_end): the whole reused prefix, planned in the main plan's launch
                if g.reuse_plan is None or g.reuse_status is None:
                    return roles["plan"]
                return [plan(fwd_plan, g.status, st.prefix_lens[:bs], st.extend_lens[:bs], window, chain,
                             (g.reuse_plan[:rows], g.reuse_status, st.reuse_end[:bs])), *stripe()]
            if name == "seal":
                return [write(Stage.HEAD)] if g.seal is not None else []
            if name == "tail_write":
                return [write(Stage.TAIL)]
            if name == "head":
                return [*self._verifies(gi, rows, name, table), *([write(Stage.HEAD)] if g.seal is None else [])]
            return self._verifies(gi, rows, name, table)  # tail_verify, reuse_verify
        roles: Lazy[str, list[Op]] = Lazy(build)
        return roles

    def _verifies(self, gi: int, rows: int, role: str, table: torch.Tensor) -> list[Op]:
        """The verify ops of group ``gi``'s ``role`` (head, tail_verify, reuse_verify) for batches of ``rows`` plan
        rows: they depend on nothing else of the shape, so every shape of those rows shares them."""
        return memo(self._verify_ops, (gi, rows, role),
                    lambda: self._bind_verifies(self.state.groups[gi], rows, role, table))

    def _write_target(self, g: GroupState, gi: int, stage: Stage, table: torch.Tensor) -> WriteTarget:
        """Group ``gi``'s write of ``stage`` but its plan rows and tokens: checked and converted once, shared by every
        shape (the structural check runs in the first group's HEAD write)."""
        st = self.state
        checks = self._checks | (self._structural if stage == Stage.HEAD and gi == 0 else 0)
        return write_target(g.views(stage), stage, g.status, table, st.sink, checks=checks, token_pool=st.token_pool,
                            fingerprint=g.fingerprint if stage == Stage.TAIL else g.seal,
                            table_page=self.pool.table_page, workspace=g.write_workspaces[stage == Stage.TAIL],
                            backend=self.backend).frozen()

    def _window(self, g: GroupState) -> int:
        """The forward plan's window: WINDOW coverage, the newest links; an SWA group, its window; else 0, every
        link."""
        return g.window if g.stripe_plan is None else self.config.window_links

    def _bind_verifies(self, g: GroupState, rows: int, role: str, table: torch.Tensor) -> list[Op]:
        st, cfg, page, b = self.state, self.config, self.pool.table_page, self.backend
        if role == "reuse_verify":
            if g.reuse_plan is None or g.reuse_status is None:
                return []
            return [bind_verify(g.head, Stage.TAIL, g.reuse_plan[:rows], g.reuse_status, table, st.sink,
                                fingerprint=g.seal, table_page=page, backend=b).frozen()]
        stage = Stage.HEAD if role == "head" else Stage.TAIL
        fp = g.fingerprint if stage == Stage.TAIL else None
        window = self._window(g)
        # (plan, status, its window: the most entries a segment holds, 0 = a whole prefix); the CUDA verify's grid
        # comes from the plan's rows times that
        plans = [(g.plan[:rows], g.status, window)] + (
            [(g.stripe_plan[:rows], g.stripe_status, cfg.stripe_size)]
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


def run(ops: Sequence[Op], table: torch.Tensor) -> None:
    """Run one stage's ops on the forward's slot table."""
    for op in ops:
        op(table)
