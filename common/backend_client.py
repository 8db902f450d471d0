"""The LLM server's sleep/wake API, which lends its GPU memory to ComfyUI. Three dialects (`api`):

- scriptorium (ours): POST /sleep?level=1&timeout=S (drains its requests for up to S seconds, frees the KV cache,
  moves the weights off the card), POST /wake_up, GET /is_sleeping -> {"is_sleeping": bool}.
- vllm: the same three routes (docs.vllm.ai, features/sleep_mode: `level` is a query parameter, 1 = weights offloaded
  to CPU memory and KV cache dropped); they exist only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1. vLLM
  takes no drain timeout, so none is sent.
- sglang: POST /release_memory_occupation and /resume_memory_occupation with a JSON body (optional "tags"; none:
  everything) under --enable-memory-saver (docs.sglang.io). SGLang has no route saying whether it is released.
- none: the server cannot lend its memory.

They live beside /v1. `detect` tells them apart for SCRIPTORIUM_LLM_SLEEP_API=auto. A server started with an API
key (ours: --api-key) wants it on these routes too: each call takes `api_key` (the settings' llm_api_key,
SCRIPTORIUM_LLM_API_KEY, the key the /v1 requests carry) and sends it as OpenAI's clients do.
"""

import httpx


def root(llm_url: str) -> str:
    """http://host:8000/v1 -> http://host:8000."""
    url = llm_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def sleep(http: httpx.AsyncClient, backend: str, drain_timeout: float, api: str = "scriptorium",
                api_key: str | None = None) -> httpx.Response:
    headers = auth_headers(api_key)
    if api == "sglang":
        return await http.post(f"{backend}/release_memory_occupation", json={}, headers=headers)
    params = {"level": 1, "timeout": drain_timeout} if api == "scriptorium" else {"level": 1}
    return await http.post(f"{backend}/sleep", params=params, headers=headers)


async def wake_up(http: httpx.AsyncClient, backend: str, api: str = "scriptorium",
                  api_key: str | None = None) -> httpx.Response:
    headers = auth_headers(api_key)
    if api == "sglang":
        return await http.post(f"{backend}/resume_memory_occupation", json={}, headers=headers)
    return await http.post(f"{backend}/wake_up", headers=headers)


async def detect(http: httpx.AsyncClient, backend: str, api_key: str | None = None) -> tuple[str, str]:
    """(api, why) for a server of unknown kind: /is_sleeping answers on ours and on vLLM in dev mode; SGLang's
    /get_server_info says whether its memory saver is on (without it a release frees nothing)."""
    headers = auth_headers(api_key)
    try:
        asked = await http.get(f"{backend}/is_sleeping", headers=headers)
        if asked.status_code == 200 and "is_sleeping" in asked.json():
            models = (await http.get(f"{backend}/v1/models", headers=headers)).json().get("data") or [{}]
            return ("scriptorium" if models[0].get("owned_by") == "scriptorium" else "vllm"), "it answers /is_sleeping"
        info = await http.get(f"{backend}/get_server_info", headers=headers)
        if info.status_code == 200 and "enable_memory_saver" in info.json():
            if info.json()["enable_memory_saver"]:
                return "sglang", "SGLang with --enable-memory-saver"
            return "none", "SGLang was started without --enable-memory-saver"
    except (httpx.HTTPError, ValueError, AttributeError, IndexError):
        pass
    return "none", ("it has no sleep API (vLLM needs --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, SGLang "
                    "--enable-memory-saver)")


def is_sleeping(backend: str, timeout: float = 5, api_key: str | None = None) -> bool:
    """False when it says so, and when it cannot be asked (SGLang cannot be)."""
    try:
        asked = httpx.get(f"{backend}/is_sleeping", timeout=timeout, headers=auth_headers(api_key))
        return bool(asked.json().get("is_sleeping"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def wake_up_now(backend: str, timeout: float = 60, api: str = "scriptorium", api_key: str | None = None) -> None:
    headers = auth_headers(api_key)
    if api == "sglang":
        httpx.post(f"{backend}/resume_memory_occupation", json={}, timeout=timeout, headers=headers)
    else:
        httpx.post(f"{backend}/wake_up", timeout=timeout, headers=headers)
