"""One question asked of a service: does its health URL answer 2xx right now?"""

import httpx


def check(url: str | None, timeout: float = 3.0) -> tuple[bool, str]:
    if not url:
        return True, "no health URL"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.TransportError as e:
        return False, f"{url}: {type(e).__name__}"
    if 200 <= response.status_code < 300:
        return True, f"{url}: {response.status_code}"
    return False, f"{url}: {response.status_code} {response.text[:120]}"
