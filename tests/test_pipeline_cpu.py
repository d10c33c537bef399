"""End-to-end CPU pipeline: plan -> HEAD verify/write -> KV write -> TAIL verify/write, then each injected fault."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from kvcanary.ops import hashes as H
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec, TokenPool
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary.truth import ChainHasher
from kvcanary_schema import (
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    CounterCol,
    FailReason,
    Group,
    Half,
    LaunchTag,
    Stage,
    ViolationCol,
    WriteCheck,
)

BACKENDS = ("torch", "cpu")
NUM_SLOTS, ROWS, ROW_LEN, LAYERS, ROW_BYTES = 64, 6, 24, 2, 32
PAD_ROW = ROWS - 1  # its table entries stay 0: the reserved padding slot
A, B, C, D = 0, 1, 2, 3  # request rows
Row = tuple[int, int, int, int]  # (tag, reasons, slot, position)
TRUTHS = ("off", "chain", "pool")


def kv_bytes(token: int, position: int, layer: int, half: int) -> torch.Tensor:
    rng = random.Random(hash((token, position, layer, half)))
    return torch.tensor([rng.randrange(256) for _ in range(ROW_BYTES)], dtype=torch.uint8)


class Pipeline:
    """A tiny engine driving the canary ops: slot allocator, slot table, real KV, token truth."""

    def __init__(self, backend: str, truth: str = "chain", seed: int = 0) -> None:
        self.backend, self.truth = backend, truth
        self.head = GroupView(torch.zeros(NUM_SLOTS, 2, 4, dtype=torch.int64), reserved_slots=1)
        self.tail = GroupView(torch.zeros(NUM_SLOTS, 2, 4, dtype=torch.int64), reserved_slots=1)
        self.kv = [[torch.zeros(NUM_SLOTS, ROW_BYTES, dtype=torch.uint8) for _ in range(LAYERS)] for _ in range(2)]
        self.fp = Fingerprint(FingerprintSources([[SourceSpec(t) for t in half] for half in self.kv], NUM_SLOTS))
        self.table = torch.zeros(ROWS, ROW_LEN, dtype=torch.int32)
        self.free = list(range(1, NUM_SLOTS))
        random.Random(seed).shuffle(self.free)
        self.lens = [0] * ROWS
        self.tokens: list[list[int]] = [[] for _ in range(ROWS)]
        self.hasher = ChainHasher()
        self.pool = TokenPool(torch.zeros(ROWS, ROW_LEN, dtype=torch.int64), torch.zeros(ROWS, dtype=torch.int64))
        self.sink = Sink.allocate(256)
        self.plan = torch.zeros(ROWS, NUM_PLAN_COLS, dtype=torch.int64)
        self.status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)

    def share(self, src: int, dst: int, k: int) -> None:
        """dst starts with src's first k tokens, reusing their slots (a prefix-cache hit)."""
        self.table[dst, :k] = self.table[src, :k]
        self.lens[dst] = k
        self.tokens[dst] = self.tokens[src][:k]
        self.hasher.extend(dst, self.tokens[dst], 0)
        self.pool.tokens[dst, :k] = self.pool.tokens[src, :k]
        self.pool.lens[dst] = k

    def forward(self, batch: list[tuple[int, list[int]]], padding: int = 0) -> list[Row]:
        """One forward of (row, new tokens) requests (+ padding tokens); returns the window's violation rows."""
        rpi: list[int] = []
        pre: list[int] = []
        ext: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        ep: list[int] = []
        en: list[int] = []
        for row, new in batch:
            p = self.lens[row]
            slots = [self.free.pop() for _ in new]
            self.table[row, p:p + len(new)] = torch.tensor(slots, dtype=torch.int32)
            rpi.append(row)
            pre.append(p)
            ext.append(len(new))
            ids += new
            pos += range(p, p + len(new))
            loc += slots
            ep.append(H.to_i64(self.hasher.value(row)))
            en.append(H.to_i64(self.hasher.extend(row, new, p)))
            self.pool.tokens[row, p:p + len(new)] = torch.tensor(new)
            self.pool.lens[row] = p + len(new)
            self.tokens[row] += new
        if padding:
            rpi.append(PAD_ROW)
            pre.append(0)
            ext.append(padding)
            ids += [0] * padding
            pos += [0] * padding
            loc += [0] * padding
            ep.append(0)
            en.append(0)

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64)

        chain = self.truth == "chain"
        plan_forward(self.plan, self.status, t(rpi), t(pre), t(ext), self.table, len(ids), padding_row=PAD_ROW,
                     expect_prefix=t(ep) if chain else None, expect_new=t(en) if chain else None,
                     backend=self.backend)
        pool = self.pool if self.truth == "pool" else None
        checks = int(WriteCheck.CHAIN_POSITION | WriteCheck.INPUTS)
        args = (self.plan, self.status, self.table)
        flat = (t(ids), t(pos), t(loc))
        verify(self.head, Stage.HEAD, *args, self.sink, token_pool=pool, backend=self.backend)
        write(self.head, Stage.HEAD, *args, *flat, self.sink, checks=checks, token_pool=pool, backend=self.backend)
        for tok, p, s in zip(ids, pos, loc, strict=True):  # the model forward writes the real KV
            for h in range(2):
                for layer in range(LAYERS):
                    self.kv[h][layer][s] = kv_bytes(tok, p, layer, h)
        verify(self.tail, Stage.TAIL, *args, self.sink, token_pool=pool, fingerprint=self.fp, backend=self.backend)
        write(self.tail, Stage.TAIL, *args, *flat, self.sink, checks=checks, token_pool=pool, fingerprint=self.fp,
              backend=self.backend)
        for row, new in batch:
            self.lens[row] += len(new)
        kept, total, dropped = self.sink.drain()
        assert dropped == 0
        return sorted((r[ViolationCol.TAG], r[ViolationCol.REASONS], r[ViolationCol.SLOT], r[ViolationCol.POSITION])
                      for r in kept.tolist())

    def slot(self, row: int, position: int) -> int:
        return int(self.table[row, position])


def warm(backend: str, truth: str = "chain") -> Pipeline:
    """Several clean steps: prefills, a prefix-cache hit, decodes and padding; asserts nothing fires."""
    rng = random.Random(4)
    pipe = Pipeline(backend, truth)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    assert pipe.forward([(A, toks(6)), (C, toks(4))]) == []
    pipe.share(A, B, 4)
    assert pipe.forward([(A, toks(1)), (B, toks(3)), (C, toks(3))], padding=2) == []
    for _ in range(2):
        assert pipe.forward([(A, toks(1)), (B, toks(1)), (C, toks(1))], padding=1) == []
    assert pipe.lens[A] == pipe.lens[C] == 9 and pipe.lens[B] == 9
    return pipe


def next_step(pipe: Pipeline) -> list[Row]:
    return pipe.forward([(A, [7]), (B, [8]), (C, [9])])


HK, HV, TK, TV = (int(LaunchTag.of(s, h, Group.FULL)) for s in (Stage.HEAD, Stage.TAIL) for h in (Half.K, Half.V))
CHAIN, POS, TOK, FP = (int(FailReason.VERIFY_CHAIN), int(FailReason.VERIFY_POSITION), int(FailReason.VERIFY_TOKEN),
                       int(FailReason.VERIFY_FINGERPRINT))
WTOK = int(FailReason.WRITE_TOKEN)


@pytest.mark.parametrize("truth", TRUTHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_workload_counts(backend: str, truth: str) -> None:
    pipe = warm(backend, truth)
    assert next_step(pipe) == []
    c = pipe.sink.counters
    verified = 0 + (6 + 4 + 4) + 3 * 7 + 3 * 8 + 3 * 9  # prefixes of the 5 forwards
    written = 10 + 7 + 3 + 3 + 3  # padding tokens are not planned, so not written
    for tag in (HK, HV, TK, TV):
        assert int(c[tag, CounterCol.VERIFY_RUNS]) == 5 and int(c[tag, CounterCol.WRITE_RUNS]) == 5
        assert int(c[tag, CounterCol.ENTRIES_CHECKED]) == verified
        assert int(c[tag, CounterCol.ENTRIES_WRITTEN]) == written
        assert int(c[tag, CounterCol.VIOLATIONS]) == 0


def _records_field(pipe: Pipeline, stage: Stage, slot: int, half: int, field: int, value: int) -> None:
    (pipe.head if stage == Stage.HEAD else pipe.tail).records[slot, half, field] = value


@pytest.mark.parametrize("backend", BACKENDS)
def test_record_token_flip(backend: str) -> None:
    pipe = warm(backend)
    _records_field(pipe, Stage.HEAD, pipe.slot(A, 5), 0, 0, 999)
    assert next_step(pipe) == [(HK, CHAIN, pipe.slot(A, 6), 6)]
    pipe = warm(backend, "pool")
    _records_field(pipe, Stage.HEAD, pipe.slot(A, 5), 0, 0, 999)
    assert next_step(pipe) == sorted([(HK, TOK, pipe.slot(A, 5), 5), (HK, CHAIN, pipe.slot(A, 6), 6)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_flip_fires_for_both_requests(backend: str) -> None:
    pipe = warm(backend)
    _records_field(pipe, Stage.TAIL, pipe.slot(A, 2), 1, 0, 999)  # A and B share positions 0..3
    assert pipe.slot(A, 3) == pipe.slot(B, 3)
    assert next_step(pipe) == [(TV, CHAIN, pipe.slot(A, 3), 3)] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_record_position_flip(backend: str) -> None:
    pipe = warm(backend)
    _records_field(pipe, Stage.HEAD, pipe.slot(C, 5), 1, 1, 6)
    assert next_step(pipe) == sorted([(HV, POS, pipe.slot(C, 5), 5), (HV, CHAIN, pipe.slot(C, 6), 6)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_record_prev_hash_flip(backend: str) -> None:
    pipe = warm(backend)
    s5 = pipe.slot(A, 5)
    pipe.tail.records[s5, 0, 2] ^= 1 << 17
    assert next_step(pipe) == sorted([(TK, CHAIN, s5, 5), (TK, CHAIN, pipe.slot(A, 6), 6)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_byte_flip(backend: str) -> None:
    pipe = warm(backend)
    s5 = pipe.slot(A, 5)
    pipe.kv[0][1][s5, 9] ^= 0x40  # K of layer 1
    assert next_step(pipe) == [(TK, FP, s5, 5)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_points_at_another_requests_slot(backend: str) -> None:
    pipe = warm(backend)
    c5 = pipe.slot(C, 5)
    pipe.table[A, 5] = c5
    a6 = pipe.slot(A, 6)
    assert next_step(pipe) == sorted([(tag, CHAIN, s, p) for tag in (HK, HV, TK, TV) for s, p in ((c5, 5), (a6, 6))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_swapped_requests_need_token_truth(backend: str) -> None:
    def swap(pipe: Pipeline) -> None:
        n = pipe.lens[A]
        ra, rc = pipe.table[A, :n].clone(), pipe.table[C, :n].clone()
        pipe.table[A, :n], pipe.table[C, :n] = rc, ra

    pipe = warm(backend, "off")
    swap(pipe)
    assert next_step(pipe) == []  # self-consistent chains: invisible without token truth

    pipe = warm(backend, "chain")
    swap(pipe)
    last_a, last_c = pipe.slot(A, 8), pipe.slot(C, 8)  # after the swap
    rows = next_step(pipe)
    new_a, new_c = pipe.slot(A, 9), pipe.slot(C, 9)
    want = [(tag, TOK, s, 8) for tag in (HK, HV, TK, TV) for s in (last_a, last_c)]
    want += [(tag, WTOK, s, 9) for tag in (HK, HV, TK, TV) for s in (new_a, new_c)]
    assert rows == sorted(want)

    pipe = warm(backend, "pool")
    truth_a, truth_c = pipe.tokens[A][:9], pipe.tokens[C][:9]
    swap(pipe)
    rows = next_step(pipe)
    verify_rows = [r for r in rows if r[1] & TOK]
    want_v = [(tag, TOK, pipe.slot(req, p), p) for tag in (HK, HV, TK, TV) for req in (A, C) for p in range(9)
              if truth_a[p] != truth_c[p]]
    assert verify_rows == sorted(want_v) and want_v


@pytest.mark.parametrize("backend", BACKENDS)
def test_use_after_free_reuse(backend: str) -> None:
    pipe = warm(backend)
    s5 = pipe.slot(A, 5)
    pipe.free.insert(len(pipe.free) - 6, s5)  # freed while A holds it: A's decode pops 1, D's 6th token gets it
    rows = pipe.forward([(A, [1]), (D, [11, 12, 13, 14, 15, 16])])
    assert pipe.slot(D, 5) == s5
    # Same forward: D's real KV lands in s5 before TAIL verifies A's prefix; only the fingerprint can see it yet.
    assert rows == [(TK, FP, s5, 5), (TV, FP, s5, 5)]
    # Next forward: D's records replaced A's (same position, other history): A's link checks fail, D is clean.
    want = [(tag, CHAIN, s, p) for tag in (HK, HV, TK, TV) for s, p in ((s5, 5), (pipe.slot(A, 6), 6))]
    assert pipe.forward([(A, [2]), (D, [17])]) == sorted(want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_fault_detected_over_seeds(backend: str) -> None:
    """Each fault class at a random position of a random request fires on the next step (token truth: chain)."""
    faults: dict[str, Callable[[Pipeline, int, int], object]] = {
        "token": lambda pp, r, p: _records_field(pp, Stage.HEAD, pp.slot(r, p), 0, 0, 5000),
        "position": lambda pp, r, p: _records_field(pp, Stage.TAIL, pp.slot(r, p), 1, 1, p + 3),
        "kv": lambda pp, r, p: pp.kv[1][0][pp.slot(r, p)].__ixor__(torch.full((ROW_BYTES,), 1, dtype=torch.uint8)),
    }
    rng = random.Random(9)
    for _ in range(3):
        for name, inject in faults.items():
            pipe = warm(backend)
            r, p = rng.choice([A, C]), rng.randrange(4, 8)
            inject(pipe, r, p)
            assert next_step(pipe), (name, r, p)
