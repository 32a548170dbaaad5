"""The tiny-model server fixtures other tests build on: a real vLLM 0.29.0 (CPU build) serving the
locally built Qwen3.5 + MTP model on 127.0.0.1, plain and with MTP speculative decoding."""

from __future__ import annotations

import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.metrics import MetricsSnapshot
from magpie.serving.process import VllmServer, group_members
from tests.conftest import MTP_TOKENS

pytestmark = pytest.mark.slow

PROMPTS = ["The cat sees the red house", "Our team builds a list quickly", "def return import class"]


@pytest.fixture(scope="module")
def plain_server(tiny_mtp_model, tmp_path_factory):
    # vLLM's CPU default process layout (tests/conftest.py runs the others' workers in the engine
    # core): the worker in a process of its own.
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="1")
    with VllmServer(tiny_mtp_model, env=env, log_path=tmp_path_factory.mktemp("plain") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def mtp_server(mtp3_server):
    """The session's shared MTP server (tests/conftest.py's pool): tiny model, MTP k=3."""
    return mtp3_server


def complete(server, prompt, max_tokens=24):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    choice = server.post("/v1/completions", body)["choices"][0]
    return choice["text"], choice["token_ids"]


def test_server_serves_a_chat_completion_and_metrics(plain_server):
    reply = plain_server.post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0},
    )
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 16
    assert MetricsSnapshot.fetch(plain_server.url).sum("vllm:generation_tokens_total") >= 16


def test_increment_model_continues_previous_id_plus_one(plain_server):
    _, ids = complete(plain_server, PROMPTS[0])
    assert len(ids) == 24
    assert all(b == a + 1 for a, b in zip(ids, ids[1:], strict=False))


def test_mtp_server_accepts_every_draft_and_matches_plain_text(plain_server, mtp_server):
    before = MetricsSnapshot.fetch(mtp_server.url)
    for prompt in PROMPTS:
        assert complete(mtp_server, prompt) == complete(plain_server, prompt)
    spec = MetricsSnapshot.fetch(mtp_server.url).spec_decode(before)
    assert spec["drafts"] > 0 and spec["num_speculative_tokens"] == MTP_TOKENS
    assert spec["accepted_tokens"] == spec["draft_tokens"]  # the MTP block predicts the target exactly
    assert spec["acceptance_length"] == pytest.approx(MTP_TOKENS + 1)  # every step yields k + 1 tokens
    assert spec["per_position_acceptance"] == [1.0] * MTP_TOKENS


def test_server_stops_by_pid_with_its_whole_process_group(plain_server, mtp_server):
    # Last in this module, so it may stop its servers (the plain one's teardown is then a no-op;
    # the pool starts the MTP one again for a later module that asks for it).
    # The plain server's CPU worker logs from a process of its own; the pooled MTP server's runs in
    # its engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, tests/conftest.py).
    assert "(Worker pid=" in plain_server.log_path.read_text()
    assert "(Worker pid=" not in mtp_server.log_path.read_text()
    for server in (plain_server, mtp_server):
        assert len(group_members(server.pid)) >= 2  # API server + engine core (+ worker)
        server.stop()
        assert not server.alive()
        assert group_members(server.pid) == []  # the engine core and workers vLLM forked are gone too
