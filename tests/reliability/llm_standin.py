"""An OpenAI-compatible stand-in for the LLM, for tests about jobs rather than text: it answers each chat completion
after a fixed delay (so that jobs overlap in time) with a valid outline when the request carries a JSON schema and
a short paragraph otherwise. The real backend on a random tiny model spends about 8 s of CPU on an outline under
the schema's grammar, which 40 articles on 2 cores cannot afford.

GET /v1/models lists one model, `standin`, with its max_model_len; GET /_test/state says how many chat requests
it answered and the most it had in flight at once. `python -m tests.reliability.llm_standin --port P --delay S`.
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "standin"


class State:
    def __init__(self, delay: float, max_model_len: int):
        self.delay, self.max_model_len = delay, max_model_len
        self.answered = self.in_flight = self.most = 0
        self.lock = threading.Lock()


def outline(schema: dict) -> dict:
    sections = schema["properties"]["sections"]["minItems"]
    return {"title": "Marginalia and their readers",
            "sections": [{"heading": f"Part {i + 1}", "key_points": ["who wrote them", "what they tell us"]}
                         for i in range(sections)]}


def answer(body: dict) -> str:
    schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")
    if schema is not None:
        return json.dumps(outline(schema))
    return "Readers wrote in the margins of their books, and those notes tell us how they read."


def handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model",
                                                             "max_model_len": state.max_model_len}]})
            elif self.path == "/_test/state":
                self._send(200, {"answered": state.answered, "most_in_flight": state.most})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            with state.lock:
                state.in_flight += 1
                state.most = max(state.most, state.in_flight)
            time.sleep(state.delay)
            text = answer(body)
            with state.lock:
                state.in_flight -= 1
                state.answered += 1
            self._send(200, {"id": "chatcmpl-standin", "object": "chat.completion", "model": MODEL,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(State(args.delay, args.max_model_len)))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
