"""Reference paged-KV inference engine (tiny seeded transformer) that hosts kvcanary's end-to-end tests."""

from .batch import ForwardBatch, ForwardMode, PoolKind
from .engine import Engine, EngineConfig, EngineStats
from .errors import ConfigError, DoubleFreeError, EngineError, PoolExhaustedError, RequestError
from .faults import IDLE_VICTIM, FaultConfig, FaultInjector
from .hooks import EngineHooks, NullHooks, RecordingHooks
from .model import ModelConfig, TinyTransformer
from .pool import KVPool, PoolView, ReqToTokenPool, SlotAllocator, SwaMap
from .radix import CachedChains, MatchResult, RadixCache, RadixNode
from .scheduler import ReqState, Request, SamplingParams, Scheduler, sample_token

__all__ = [
    "CachedChains", "ConfigError", "DoubleFreeError", "Engine", "EngineConfig", "EngineError",
    "EngineHooks", "EngineStats", "IDLE_VICTIM", "FaultConfig", "FaultInjector", "ForwardBatch", "ForwardMode",
    "KVPool", "MatchResult", "ModelConfig", "NullHooks", "PoolExhaustedError", "PoolKind", "PoolView",
    "RadixCache", "RadixNode", "RecordingHooks", "ReqState", "ReqToTokenPool", "Request",
    "RequestError", "SamplingParams", "Scheduler", "SlotAllocator", "SwaMap", "TinyTransformer",
    "sample_token",
]
