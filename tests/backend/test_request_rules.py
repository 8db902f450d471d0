"""Each sampling rule is checked once, by SamplingParams, with the ranges each API documents; a bad value is a
400 naming the field as the client sent it, in the one message that rule has."""

import httpx
import pytest

from backend.sampling_params import RANGES, InvalidParameter, SamplingParams
from backend.server.api_fields import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_COMPLETIONS, OPENAI_RESPONSES

HI = [{"role": "user", "content": "hi"}]


def _openai_error(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _anthropic_error(server, body: dict) -> str:
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "tiny", "messages": HI, **body},
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def _rule(field: str, **settings) -> str:
    """The one message SamplingParams has for the rule these settings break, with the field named as sent."""
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**settings)
    return str(e.value).replace(e.value.param, field, 1)


@pytest.mark.parametrize("api", [OPENAI_COMPLETIONS, OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES])
def test_each_api_range_lies_within_the_engines(api):
    for name, allowed in api.ranges.items():
        engine = RANGES[name]
        assert engine.holds(allowed.low) and (allowed.high is None or engine.holds(allowed.high)), name
        assert allowed.high is not None or engine.high is None, name


def test_the_documented_ranges_bound_each_api(qwen_server):
    ok = httpx.post(
        f"{qwen_server.url}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": HI, "max_tokens": 1, "temperature": 2.0},
    )
    assert ok.status_code == 200, ok.text
    error = _openai_error(qwen_server, "/v1/chat/completions", {"messages": HI, "temperature": 2.01})
    assert error["param"] == "temperature" and error["message"].startswith("temperature must be in [0, 2] ")

    ok = httpx.post(
        f"{qwen_server.url}/v1/messages",
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
        json={"model": "tiny", "messages": HI, "max_tokens": 1, "temperature": 1.0},
    )
    assert ok.status_code == 200, ok.text
    assert _anthropic_error(qwen_server, {"max_tokens": 5, "temperature": 1.5}).startswith(
        "temperature must be in [0, 1] "
    )


@pytest.mark.parametrize(
    "path,body,field,settings",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens", {"max_tokens": -3}),
        ("/v1/completions", {"prompt": "x", "logprobs": 30}, "logprobs", {"logprobs": 30}),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_completion_tokens": 0},
            "max_completion_tokens",
            {"max_tokens": 0},
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "logprobs": True, "top_logprobs": 30},
            "top_logprobs",
            {"logprobs": 30},
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "frequency_penalty": -2.5},
            "frequency_penalty",
            {"frequency_penalty": -2.5},
        ),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens", {"max_tokens": 0}),
        ("/v1/responses", {"input": "hi", "top_p": 1.5}, "top_p", {"top_p": 1.5}),
    ],
)
def test_openai_fields_are_named_as_sent(qwen_server, path, body, field, settings):
    error = _openai_error(qwen_server, path, body)
    assert error["param"] == field and error["message"] == _rule(field, **settings)


@pytest.mark.parametrize(
    "body,field,settings",
    [
        ({"max_tokens": 0}, "max_tokens", {"max_tokens": 0}),
        ({"max_tokens": 5, "top_k": -4}, "top_k", {"top_k": -4}),
        ({"max_tokens": 5, "stop_sequences": ["x"] * 65}, "stop_sequences", {"stop": ["x"] * 65}),
    ],
)
def test_anthropic_fields_are_named_as_sent(qwen_server, body, field, settings):
    assert _anthropic_error(qwen_server, body) == _rule(field, **settings)
