"""A long generation that holds a server's only sequence slot (serve --max-num-seqs 1) until the test lets it
go: a request sent meanwhile waits without output for as long as the test chooses, as behind a long prompt."""

import threading

import httpx


class Blocker:
    def __init__(self, url: str, model: str):
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, model), daemon=True)
        self.thread.start()
        assert self.started.wait(300), "the blocking generation never started"

    def _run(self, url: str, model: str) -> None:
        # as long as the context allows (a max_tokens past it is cut to what fits): minutes on the CPU
        body = {
            "model": model,
            "prompt": "The scribe",
            "max_tokens": 1 << 20,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1200) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.started.set()
                if self.stop.is_set():
                    return

    def release(self) -> bool:
        """Close its stream (the server aborts it); True when it was still generating, holding the slot."""
        running = self.thread.is_alive()
        self.stop.set()
        self.thread.join(60)
        return running
