"""The OpenAI Agents SDK (openai-agents) driving the real server end to end, as a user would: an agent
with a Python function tool, over /v1/chat/completions and over /v1/responses (streamed), calls the tool
and answers with its result in the conversation."""

import asyncio
import json

import jsonschema
import openai
import pytest

agents = pytest.importorskip("agents")  # a dev dependency (pyproject); absent, these tests cannot run

WEATHER = "It is 18 degrees and sunny in {city}."


def run_agent(url: str, api: str, streamed: bool) -> tuple[list[str], object, dict]:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return WEATHER.format(city=city)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        kind = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
        settings = agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
        )
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=kind(model="smol", openai_client=client),
            model_settings=settings,
        )
        question = "What is the weather like in Paris today?"
        if not streamed:
            return await agents.Runner.run(agent, question, max_turns=3)
        result = agents.Runner.run_streamed(agent, question, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    agents.set_tracing_disabled(True)  # no traces sent to OpenAI's servers
    return calls, asyncio.run(main()), get_weather.params_json_schema


@pytest.mark.parametrize(("api", "streamed"), [("chat", False), ("responses", True)])
def test_an_agent_calls_a_python_tool_and_answers_with_its_result(smol_server, api, streamed):
    calls, result, schema = run_agent(smol_server.url, api, streamed)
    kinds = [type(item).__name__ for item in result.new_items]
    # tool_choice="required" holds for the first turn only (the SDK resets it), so the second answers.
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert len(calls) == 1 and calls[0]
    call = result.new_items[0].raw_item
    arguments = json.loads(call.arguments if hasattr(call, "arguments") else call["arguments"])
    jsonschema.validate(arguments, schema)
    assert result.new_items[1].output == WEATHER.format(city=calls[0])
    assert isinstance(result.final_output, str) and result.final_output.strip()
