"""Requests, sampling, per-request state and the waiting/running queues."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .errors import RequestError
from .radix import RadixNode


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0, else seeded temperature sampling (one draw per output index)."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")


@dataclass(frozen=True)
class Request:
    """A generation request."""

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise RequestError("empty prompt")
        if self.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be >= 1")


@dataclass
class ReqState:
    """Engine-side state of a request.

    Target KV is valid for positions [0, kv_len); draft KV (offset +1) for [0, draft_len).
    Positions [0, cached_len) are owned by the radix cache (node locked); the rest by the request.
    """

    req: Request
    tokens: list[int]
    row: int = -1
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    draft_len: int = 0
    cached_len: int = 0
    node: RadixNode | None = None
    swa_freed_upto: int = 0
    draft_next: int = -1
    prefilled: bool = False
    retractions: int = 0

    @property
    def rid(self) -> str:
        """Request id."""
        return self.req.rid

    @property
    def num_outputs(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - len(self.req.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return self.req.max_new_tokens - self.num_outputs

    @property
    def in_prefill(self) -> bool:
        """Whether the (re)admitted request has not sampled yet: its tokens still need KV."""
        return not self.prefilled

    def output(self) -> list[int]:
        """Generated tokens."""
        return self.tokens[len(self.req.prompt):]


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Greedy argmax, or a draw seeded by (seed, output index) so batching never changes it."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / params.temperature, dim=-1)
    gen = torch.Generator().manual_seed(params.seed * 1_000_003 + index)
    return int(torch.multinomial(probs, 1, generator=gen))


class Scheduler:
    """FIFO waiting queue and admitted (running) requests."""

    def __init__(self) -> None:
        self.waiting: deque[ReqState] = deque()
        self.running: list[ReqState] = []
        self.finished: dict[str, ReqState] = {}

    def known(self, rid: str) -> bool:
        """Whether a request id was seen."""
        return rid in self.finished or any(s.rid == rid for s in (*self.waiting, *self.running))

    def get_running(self, rid: str) -> ReqState:
        """A running request by id."""
        for s in self.running:
            if s.rid == rid:
                return s
        raise RequestError(f"request {rid} is not running")

    def plan_prefill(self, budget: int) -> list[tuple[ReqState, int]]:
        """Running requests in prefill, each with the end of its next chunk, within a token budget."""
        plan = []
        for s in self.running:
            if budget <= 0:
                break
            if s.in_prefill:
                end = min(len(s.tokens), s.kv_len + budget)
                plan.append((s, end))
                budget -= end - s.kv_len
        return plan

    def decoding(self) -> list[ReqState]:
        """Running requests past prefill."""
        return [s for s in self.running if not s.in_prefill]
