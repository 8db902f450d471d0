"""The backend's sleep/wake API, which lends its GPU memory to ComfyUI: POST /sleep?level=1&timeout=S (drain,
free the KV cache, weights off the card), POST /wake_up, GET /is_sleeping. They live beside /v1."""

import httpx


def root(llm_url: str) -> str:
    """http://host:8000/v1 -> http://host:8000."""
    url = llm_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def sleep(http: httpx.AsyncClient, backend: str, drain_timeout: float) -> httpx.Response:
    return await http.post(f"{backend}/sleep", params={"level": 1, "timeout": drain_timeout})


async def wake_up(http: httpx.AsyncClient, backend: str) -> httpx.Response:
    return await http.post(f"{backend}/wake_up")


def is_sleeping(backend: str, timeout: float = 5) -> bool:
    """False when it says so, and when it cannot be asked."""
    try:
        return bool(httpx.get(f"{backend}/is_sleeping", timeout=timeout).json().get("is_sleeping"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def wake_up_now(backend: str, timeout: float = 60) -> None:
    httpx.post(f"{backend}/wake_up", timeout=timeout)
