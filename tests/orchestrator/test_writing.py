"""A section the model leaves empty (a small model can end at its first token) is asked for again, up to three
times, before the step fails with a message that says so. The backend is the real one; its first answers end
at once with no text, as a model's do when it samples its end token first."""

import asyncio
import dataclasses

import pytest

from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.writing import write_section
from tests.orchestrator.inprocess_backend import InProcessBackend

OUTLINE = {"title": "Quills", "sections": [{"heading": "Cutting a nib", "key_points": ["a sharp knife"]}]}


@pytest.fixture
def backend(tiny_dir):
    made = InProcessBackend(str(tiny_dir("llama")), max_model_len=512)
    yield made
    made.stop()


def end_at_once(backend: InProcessBackend, times: int) -> None:
    """Make the next `times` requests answer as a model whose first token is its end token: one token, no text."""
    engine = backend.state.engine
    generate, left = engine.generate, [times]

    async def patched(request_id, request, group=None, client=None):
        empty = left[0] > 0
        left[0] -= empty
        once = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=1))
        async for delta in generate(request_id, once if empty else request, group, client):
            for output in delta.outputs if empty else ():
                output.text = ""
            yield delta

    engine.generate = patched


def write(backend: InProcessBackend) -> str:
    async def go():
        async with LLMRouter([f"{backend.url}/v1"], model="tiny") as router:
            return await write_section(router, OUTLINE, 0, ArticleParams(topic="quills", words_per_section=30, seed=3))

    return asyncio.run(go())


def test_an_empty_section_is_asked_for_again(backend):
    end_at_once(backend, 2)
    assert write(backend).strip()
    assert backend.posts() == 3


def test_a_section_left_empty_three_times_fails_clearly(backend):
    end_at_once(backend, 3)
    with pytest.raises(ValueError, match="wrote nothing for section 1 in 3 attempts"):
        write(backend)
    assert backend.posts() == 3
