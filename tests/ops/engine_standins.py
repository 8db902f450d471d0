"""Stand-ins for vLLM's and SGLang's OpenAI servers: vLLM and SGLang need a GPU and gigabytes of packages, so ops'
tests run these instead. They take the same command lines and answer the same HTTP routes, as documented:

vLLM (docs.vllm.ai: "vllm serve" CLI, features/sleep_mode, vllm/entrypoints/serve/sleep/api_router.py)
- `vllm serve MODEL --host H --port P --gpu-memory-utilization F --enable-sleep-mode`; F is a float in (0, 1]
  (argparse rejects "18GiB"); the port defaults to 8000.
- GET /health: 200 with an empty body while the engine runs. GET /v1/models: the served model, owned_by "vllm".
- POST /sleep?level=1|2 (query parameter `level`, default "1"): 200 with an empty body; POST /wake_up (optional
  `tags` query parameters): 200; GET /is_sleeping: {"is_sleeping": bool}. These routes are attached only when
  VLLM_SERVER_DEV_MODE=1 (attach_router returns early otherwise), so without it they are 404 {"detail": ...}.
  Sleeping without --enable-sleep-mode fails inside the engine: the route answers 500.

SGLang (docs.sglang.io: server arguments, "SGLang for RL"; python/sglang/srt/entrypoints/http_server.py)
- `python -m sglang.launch_server --model-path M --host H --port P --mem-fraction-static F --enable-memory-saver`;
  the port defaults to 30000.
- GET /health: 200, empty. GET /get_model_info: model_path, tokenizer_path, is_generation. GET /get_server_info:
  the server arguments (enable_memory_saver, mem_fraction_static, ...) and version. GET /v1/models: owned_by "sglang".
- GET or POST /release_memory_occupation and /resume_memory_occupation take a JSON object (the Release/Resume
  MemoryOccupationReqInput dataclass, "tags" optional) and return nothing, so FastAPI answers 200 with the JSON body
  `null`; no body, or one that is not an object, is FastAPI's 422 {"detail": [...]}. With --enable-memory-saver off
  they still answer 200 but free nothing (the memory saver adapter only logs a warning).

Both: POST /v1/chat/completions answers a fixed short reply (stream or not). Test-only: GET /_test/state. With
STANDIN_RECORD=path each writes its argv and the variables it was given to that file when it starts.
"""

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class Engine:
    def __init__(self, kind: str, model: str, dev_mode: bool, sleep_mode: bool, args: dict):
        self.kind, self.model, self.dev_mode, self.sleep_mode, self.args = kind, model, dev_mode, sleep_mode, args
        self.asleep = False  # vLLM: sleeping; SGLang: memory released
        self.level = 0
        self.calls: list[dict] = []
        self.lock = threading.Lock()


def _handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body=None, content_type="application/json"):
            data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            if data:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict | None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw.strip() else None

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def _route(self, method: str):
            url = urlparse(self.path)
            query = parse_qs(url.query)
            body = self._body()
            with engine.lock:
                engine.calls.append({"method": method, "path": url.path, "query": query, "body": body})
            if url.path == "/_test/state":
                return self._send(200, {"asleep": engine.asleep, "level": engine.level, "calls": engine.calls,
                                        "args": engine.args})
            if url.path == "/health":
                return self._send(200)
            if url.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": engine.model, "object": "model",
                                                                   "created": int(time.time()), "owned_by": engine.kind,
                                                                   "root": engine.model}]})
            if url.path == "/v1/chat/completions" and method == "POST":
                return self._chat(body or {})
            if engine.kind == "vllm":
                return self._vllm(method, url.path, query)
            return self._sglang(url.path, body)

        def _vllm(self, method: str, path: str, query: dict):
            routes = {("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")}
            if (method, path) not in routes or not engine.dev_mode:
                return self._send(404, {"detail": "Not Found"})
            if path == "/is_sleeping":
                return self._send(200, {"is_sleeping": engine.asleep})
            if not engine.sleep_mode:
                return self._send(500, b"Internal Server Error", "text/plain")
            if path == "/sleep":
                engine.asleep, engine.level = True, int(query.get("level", ["1"])[0])
            else:
                engine.asleep, engine.level = False, 0
            return self._send(200)

        def _sglang(self, path: str, body: dict | None):
            if path == "/get_model_info":
                return self._send(200, {"model_path": engine.model, "tokenizer_path": engine.model,
                                        "is_generation": True})
            if path == "/get_server_info":
                return self._send(200, {**engine.args, "version": "0.0.0-standin"})
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                if not isinstance(body, dict):
                    problem = "missing" if body is None else "dataclass_type"
                    return self._send(422, {"detail": [{"type": problem, "loc": ["body"], "input": body,
                                                        "msg": "Field required" if body is None else
                                                        "Input should be a dictionary or an instance of the dataclass"}]})
                if engine.sleep_mode:  # without --enable-memory-saver nothing is freed, and it still says 200
                    engine.asleep = path == "/release_memory_occupation"
                return self._send(200, b"null")
            return self._send(404, {"detail": "Not Found"})

        def _chat(self, body: dict):
            words = ["a", "quill", "writes"][: max(1, min(3, int(body.get("max_tokens") or 3)))]
            usage = {"prompt_tokens": 4, "completion_tokens": len(words), "total_tokens": 4 + len(words)}
            base = {"id": "chatcmpl-standin", "created": int(time.time()), "model": body.get("model") or engine.model}
            if not body.get("stream"):
                return self._send(200, {**base, "object": "chat.completion", "usage": usage, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": " ".join(words)},
                     "finish_reason": "length"}]})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, word in enumerate(words):
                chunk = {**base, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": (" " if i else "") + word},
                     "finish_reason": "length" if i == len(words) - 1 else None}]}
                self._chunk(f"data: {json.dumps(chunk)}\n\n")
            self._chunk("data: [DONE]\n\n")
            self._chunk("")

        def _chunk(self, text: str):
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def _record(argv: list[str]) -> None:
    path = os.environ.get("STANDIN_RECORD")
    if path:
        keep = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "SGLANG_", "SCRIPTORIUM_", "HF_"))}
        with open(path, "w") as f:
            json.dump({"argv": argv, "env": keep}, f)


def _fraction(text: str) -> float:
    value = float(text)  # argparse turns the ValueError of "18GiB" into a usage error, as vLLM's and SGLang's do
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def vllm_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    serve.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    _record(["vllm", *argv])
    engine = Engine("vllm", args.served_model_name or args.model, os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
                    args.enable_sleep_mode, {"gpu_memory_utilization": args.gpu_memory_utilization})
    ThreadingHTTPServer((args.host or "0.0.0.0", args.port), _handler(engine)).serve_forever()


def sglang_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--mem-fraction-static", type=_fraction, default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    args = parser.parse_args(argv)
    _record(["python", "-m", "sglang.launch_server", *argv])
    server_args = {"model_path": args.model_path, "host": args.host, "port": args.port,
                   "mem_fraction_static": args.mem_fraction_static, "enable_memory_saver": args.enable_memory_saver}
    engine = Engine("sglang", args.model_path, False, args.enable_memory_saver, server_args)
    ThreadingHTTPServer((args.host, args.port), _handler(engine)).serve_forever()


if __name__ == "__main__":
    {"vllm": vllm_main, "sglang": sglang_main}[sys.argv[1]](sys.argv[2:])
