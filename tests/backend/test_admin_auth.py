"""A server started with --api-key wants the key on every route but the probes' (/, /health, /metrics): /sleep
and /wake_up without it are a 401 that changes nothing, however the path is spelled, and with it they work."""

import socket

import httpx
import pytest

from tests.backend.server_process import ServerProcess

KEY = "sekrit-admin"
BEARER = {"Authorization": f"Bearer {KEY}"}
HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--api-key", KEY)
    yield server
    assert server.stop() == 0


@pytest.fixture
def keyed(server):
    """The module's server, awake for each test (a failed one may have left it asleep)."""
    httpx.post(f"{server.url}/wake_up", headers=BEARER, timeout=60)
    yield server
    httpx.post(f"{server.url}/wake_up", headers=BEARER, timeout=60)


def raw_status(server, request_line: str, *headers: str) -> int:
    """The status of a request sent byte for byte (no client normalises its path or method)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        head = [request_line, f"Host: 127.0.0.1:{server.port}", "Content-Length: 0", "Connection: close", *headers]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        reply = b""
        while b"\r\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def assert_awake_and_serving(server) -> None:
    assert httpx.get(f"{server.url}/is_sleeping", headers=BEARER).json() == {"is_sleeping": False}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=HI, headers=BEARER, timeout=120)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/sleep?level=2"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
    ],
)
def test_admin_routes_without_the_key_are_refused_and_change_nothing(keyed, method, path):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": KEY + "x"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, f"{keyed.url}{path}", headers=headers, json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.headers["www-authenticate"]
    assert_awake_and_serving(keyed)


@pytest.mark.parametrize(
    "request_line",
    [
        "POST /sleep?level=2 HTTP/1.1",
        "POST /sleep/?level=2 HTTP/1.1",
        "POST //sleep?level=2 HTTP/1.1",
        "POST /SLEEP?level=2 HTTP/1.1",
        "POST /%73leep?level=2 HTTP/1.1",
        "POST /%2Fsleep?level=2 HTTP/1.1",
        "POST /health/../sleep?level=2 HTTP/1.1",
        "POST /health%2F..%2Fsleep?level=2 HTTP/1.1",
        "GET /sleep?level=2 HTTP/1.1",
        "HEAD /sleep?level=2 HTTP/1.1",
        "PUT /sleep?level=2 HTTP/1.1",
        "OPTIONS /sleep HTTP/1.1",
        "POST /wake_up/ HTTP/1.1",
    ],
)
def test_no_spelling_of_sleep_gets_past_the_key(keyed, request_line):
    assert raw_status(keyed, request_line) == 401
    assert raw_status(keyed, request_line, "Authorization: Bearer", "x-api-key: ") == 401
    assert_awake_and_serving(keyed)


def test_with_the_key_sleep_and_wake_up_work_in_both_header_forms(keyed):
    assert httpx.post(f"{keyed.url}/sleep", params={"level": 2}).status_code == 401
    r = httpx.post(f"{keyed.url}/sleep", params={"level": 2}, headers=BEARER, timeout=60)
    assert r.status_code == 200 and r.json()["is_sleeping"] is True
    assert httpx.post(f"{keyed.url}/wake_up", timeout=60).status_code == 401  # nor can anyone wake it
    assert httpx.get(f"{keyed.url}/is_sleeping", headers={"x-api-key": KEY}).json() == {"is_sleeping": True}
    asleep = httpx.post(f"{keyed.url}/v1/chat/completions", json=HI, headers=BEARER, timeout=60)
    assert asleep.status_code == 503 and asleep.headers["retry-after"]
    assert httpx.post(f"{keyed.url}/wake_up", headers={"x-api-key": KEY}, timeout=60).json() == {"is_sleeping": False}
    assert_awake_and_serving(keyed)


def test_only_the_probes_routes_are_open(keyed):
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{keyed.url}/metrics")
    assert metrics.status_code == 200 and "scriptorium_sleeping" in metrics.text
    assert httpx.get(f"{keyed.url}/").status_code == 200 and httpx.head(f"{keyed.url}/").status_code == 200
    assert httpx.post(f"{keyed.url}/health").status_code == 405  # open means what it serves, not more
    for path in ("/health/", "/metrics/x", "/is_sleeping", "/v1/models"):  # beside them: keyed
        assert httpx.get(f"{keyed.url}{path}").status_code == 401, path
