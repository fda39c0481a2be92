"""The gateway tests' shared cluster: the tiny chat model under `pagedserve up --http-port`
(redis-server, router, prefill and decode workers, gateway: real processes), the one
tests/router/test_chat_e2e.py and tests/examples use too, and an official `openai` client of it.
A module that needs a cluster of its own (test_openai_e2e.py: keys, traces) defines its own
`cluster` and `client`."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, clusters):
    """(the running cluster, the model directory)."""
    return clusters.get(tiny_chat_model, http_port=0), tiny_chat_model


@pytest.fixture(scope="module")
def client(cluster):
    url = cluster[0].http_url
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster[1].name
