"""kvcanary in vLLM: RAISE mode through MultiConnector (only the affected request fails), metrics, bad configuration."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm.config")

import torch  # noqa: E402
from vllm_util import BLOCK, CONNECTOR, Driver, close, make_llm, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama-raise"), layers=2)


@pytest.fixture(scope="module")
def raise_llm(model: str) -> Any:
    from vllm.config import KVTransferConfig

    canary = dict(CONNECTOR, kv_connector_extra_config={"mode": "raise", "fingerprint": "all",
                                                         "layer_coverage": "all", "sweep_interval": 0})
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="fail",
                             kv_connector_extra_config={"connectors": [canary]})
    engine = make_llm(model, connector=False, kv_transfer_config=multi)
    yield engine
    close(engine)


def test_raise_fails_only_the_affected_request(raise_llm: Any) -> None:
    d = Driver(raise_llm)
    rng = random.Random(9)
    d.add("hit", [rng.randrange(1, 500) for _ in range(2 * BLOCK + 4)], 12)
    d.add("bystander", [rng.randrange(1, 500) for _ in range(2 * BLOCK + 4)], 12)
    for _ in range(3):
        d.step()
    rid = d.internal("hit")
    block = d.blocks(rid)[1]
    v = d.worker.canary.pool.groups[0].sources[0][0].tensor  # V half (CPU_ATTN), layer 0, head 0
    v[block, 7].view(torch.int16)[0] ^= 1 << 9
    finished: dict[str, Any] = {}
    for _ in range(40):
        for out in d.engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        if not d.engine.has_unfinished_requests():
            break
    assert finished["hit"].finish_reason == "error"
    assert finished["bystander"].finish_reason == "length" and len(finished["bystander"].token_ids) == 12
    bad = [x for r in d.worker.reports for x in r.violations]
    assert bad and {x.request_id for x in bad} == {rid}
    assert d.pool.blocks[block].block_hash is None  # evicted: no later request reuses it


def test_stats_reach_vllm_and_its_prometheus_registry(raise_llm: Any) -> None:
    import functools

    import prometheus_client as prom
    from kvcanary.integrations.vllm import KVCanaryConnector

    d = Driver(raise_llm)
    seen: list[Any] = []
    orig = d.conn.get_kv_connector_stats

    def spy() -> Any:  # what vLLM's model runner collects every step
        out = orig()
        seen.append(out)
        return out

    d.conn.get_kv_connector_stats = spy
    try:
        d.add("s", list(range(1, 40)), 4)
        d.run()
    finally:
        del d.conn.get_kv_connector_stats
    stats = [x for x in seen if x is not None]
    assert sum(x.data["forwards"] for x in stats) >= 4 and sum(x.data["host_us"] for x in stats) > 0
    reg = prom.CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (prom.Gauge, prom.Counter, prom.Histogram)}
    metrics = KVCanaryConnector.build_prom_metrics(raise_llm.llm_engine.vllm_config, types, ["engine"], {0: ["0"]})
    for x in stats:
        metrics.observe(x.reduce(), 0)
    total = sum(x.data["forwards"] for x in stats)
    assert reg.get_sample_value("vllm:kvcanary_forwards_total", {"engine": "0"}) == total


def test_unknown_option_fails_at_engine_start(model: str) -> None:
    with pytest.raises(Exception, match="unknown kv_connector_extra_config option"):
        make_llm(model, {"fingerprints": "all"})


def test_bad_value_fails_at_engine_start(model: str) -> None:
    with pytest.raises(Exception, match="CanaryConfig.mode"):
        make_llm(model, {"mode": "loud"})


def test_unreadable_layouts_are_clear_errors() -> None:
    from kvcanary.integrations.vllm import VLLMIntegrationError, probe_layout, runs_of

    with pytest.raises(VLLMIntegrationError, match="cannot read the KV layout of attention backend 'FLASHINFER'"):
        probe_layout("FLASHINFER", torch.zeros(4, 2, 32, 64), 32, 2, 32, None)
    # a token-major run per head is readable; a transposed one (CPU_ATTN's K with the vec ISA) is not
    assert runs_of([[h * 64 + t * 32 + d for h in range(2) for d in range(32)] for t in range(2)], 2, 32) == [0, 64]
    assert runs_of([[d * 32 + t for d in range(32)] for t in range(2)], 1, 32) is None


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs an AMX CPU: only there does vLLM's "
                    "CPU_ATTN pick its amx kernels")
def test_amx_layout_fingerprints_fail_clearly_and_fingerprint_none_runs(model: str) -> None:
    """bf16 on an AMX CPU: CPU_ATTN's amx kernels pack K and V by pairs of tokens, so no half is token-major. A
    fingerprint mode fails at engine start, naming the isa and the ways out; fingerprint=none runs clean. (The other
    tests run float32, whose kernels keep V token-major on any x86 CPU.)"""
    from kvcanary.integrations.vllm import probe_layout
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm_util import connectors

    assert probe_layout("CPU_ATTN", torch.zeros(1, 2, BLOCK, 64, dtype=torch.bfloat16), BLOCK, 2, 32,
                        "amx") == (None, None)
    with pytest.raises(Exception, match="isa 'amx'.*fingerprint=none, or dtype float32"):
        make_llm(model, {"fingerprint": "partial"}, dtype="bfloat16")
    ensure_kv_transfer_shutdown()  # the failed start's connector
    llm = make_llm(model, {"fingerprint": "none"}, dtype="bfloat16")
    try:
        rng = random.Random(3)
        prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(60)]} for _ in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        worker = connectors(llm)[1].worker
        worker.canary.flush()
        assert worker.canary.forwards > 0 and sum(r.total for r in worker.reports) == 0
    finally:
        close(llm)
