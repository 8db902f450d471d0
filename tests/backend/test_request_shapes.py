"""Fields of the wrong shape inside a request are 400s that name them, on a real server through one kept-alive
connection; and an unexpected error is a 500 in the API's shape that leaves the connection usable (found by an
attacker's probe: these crashed their handlers, and each crash reset the client's connection)."""


import httpx
import pytest

from backend.config import EngineConfig
from backend.server import app as server_app
from tests.serving import serve_in_thread, wait_healthy

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": "x"}},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": -1}},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/responses", {**RESPONSES, "text": {"format": "json_object"}}, "text.format"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": "pat", "description": ["x"]}]},
     "tools[0].description"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": None}]}, "tools[0].name"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": ["a"]}]}, "tools[0].name"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": "c", "format": "x"}]}, "tools[0].format"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "custom", "name": 3}]}]}, "tools[0].tools[0].name"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": "c"}],
                       "tool_choice": {"type": "custom", "name": "c", "namespace": 5}}, "tool_choice"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "custom", "name": "c"}],
                       "tool_choice": {"type": "function", "name": None}}, "tool_choice"),
    ("/v1/responses", {**RESPONSES, "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                              "arguments": "{}", "namespace": 5}]}, "input[0].namespace"),
])
def test_a_field_of_the_wrong_shape_is_a_400_naming_it(path, body, param, qwen_server):
    with httpx.Client(base_url=qwen_server.url, timeout=60) as client:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert client.get("/v1/models").status_code == 200  # the same connection, still open


@pytest.fixture(scope="module")
def in_process(tiny_dir):
    """Our app on a real uvicorn server in this process, so that a test can make a route fail unexpectedly."""
    app = server_app.build_app(EngineConfig(model=str(tiny_dir("llama")), block_size=8, max_model_len=128), "tiny")
    server, _, url = serve_in_thread(app)
    wait_healthy(url, 120, what="the in-process server")
    yield url
    server.should_exit = True


def test_an_unexpected_error_is_a_500_in_the_apis_shape_and_the_connection_stays(in_process, monkeypatch):
    async def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server_app, "create_chat_completion", broken)
    monkeypatch.setattr(server_app, "create_message", broken)
    with httpx.Client(base_url=in_process, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "internal error: a bug", "type": "internal_error", "param": None,
                                     "code": None}
        r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500
        assert r.json() == {"type": "error", "error": {"type": "api_error", "message": "internal error: a bug"}}
        # the kept-alive connection carries the next request (before, the server closed it: a reset)
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_allowed_token_ids_that_leave_the_schema_no_token_are_a_400(qwen_server):
    """Settings that contradict each other only once generation starts (no allowed token is one the JSON schema
    allows next) fail the request as the client's error, naming allowed_token_ids: a 400, or in a stream an error
    event (before: a 500 "token 0 does not continue the output's grammar")."""
    body = {**CHAT, "max_tokens": 8, "allowed_token_ids": [1, 2, 3], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    with httpx.Client(base_url=qwen_server.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "allowed_token_ids" and "leaves no token that the output's JSON schema" in \
            error["message"] and "after 0 generated tokens" in error["message"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert "leaves no token that the output's JSON schema" in events[-2] and events[-1] == "data: [DONE]"
        plain = client.post("/v1/chat/completions", json={**body, "allowed_token_ids": None})
        assert plain.status_code == 200
