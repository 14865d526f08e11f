"""Sustained load: 10,000 embedding requests from 16 concurrent clients, no error, no leak.

A real coordinator and three real agents on 127.0.0.1 serve MiniLM cut in three (see
``load_lab``). Sixteen threads, each with its own keep-alive HTTP client, send one-sentence
``/v1/embeddings`` requests until 10,000 are answered. Every answer must be a 200; the resident
memory of the coordinator and of each agent, sampled after the first 1,000 answers and after
the last, may grow by less than 5 %. Latency percentiles are the load benchmark's business
(``bench/load.py``), not asserted here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
log = logging.getLogger(__name__)

REQUESTS = 10_000
CLIENTS = 16
SAMPLE_EVERY = 1_000
LOAD_DEADLINE_S = 420.0
"""The load phase fails if the 10,000 requests take longer (about 130 s here on 2 cores)."""
MAX_GROWTH = 0.05


def test_10000_embeddings_from_16_clients_without_error_or_growth(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from agent_helpers import minilm_model
    from load_lab import minilm_lab, run_load

    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    with minilm_lab(tmp_path, model) as lab:
        result = run_load(lab, REQUESTS, CLIENTS, SAMPLE_EVERY, deadline_s=LOAD_DEADLINE_S)
        procs = [lab.coordinator.proc, *(agent.proc for agent in lab.agents)]
        alive = [proc.poll() is None for proc in procs]
    log.info(
        "%d requests in %.1f s (%.1f/s), %d errors; RSS growth %s",
        len(result.latencies_s),
        result.seconds,
        result.throughput,
        len(result.errors),
        {name: f"{result.growth(name):+.2%}" for name in result.memory},
    )
    assert result.errors == [], result.errors[:5]
    assert len(result.latencies_s) == REQUESTS, (
        f"only {len(result.latencies_s)} of {REQUESTS} requests in {LOAD_DEADLINE_S:.0f} s"
    )
    assert all(alive), alive
    for name, samples in result.memory.items():
        assert len(samples) == REQUESTS // SAMPLE_EVERY, (name, samples)
        growth = result.growth(name)
        assert growth < MAX_GROWTH, f"{name}: RSS {samples[0]} -> {samples[-1]} ({growth:+.1%})"
