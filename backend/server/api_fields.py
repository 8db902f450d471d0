"""Each API's sampling fields as SamplingParams takes them: the names its requests give them and the ranges its
reference documents (OpenAI's temperature in [0, 2], Anthropic's in [0, 1]). SamplingParams checks each rule
with these, once; the request shapes translate and do not check again. top_p stays the engine's (0, 1]: both
references allow 0, which has no nucleus to sample from."""

from dataclasses import replace

from backend.sampling_params import ApiFields, Range

_OPENAI_RANGES = {
    "temperature": Range(0, 2),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
}

OPENAI_COMPLETIONS = ApiFields(ranges=_OPENAI_RANGES)
# chat's top_logprobs is the engine's logprobs; its output limit is max_completion_tokens or max_tokens (chat.py)
OPENAI_CHAT = ApiFields(names={"logprobs": "top_logprobs"}, ranges=_OPENAI_RANGES)
OPENAI_RESPONSES = ApiFields(
    names={"max_tokens": "max_output_tokens", "guided_json": "text.format"}, ranges=_OPENAI_RANGES
)
ANTHROPIC_MESSAGES = ApiFields(
    names={"max_tokens": "max_tokens", "stop": "stop_sequences", "guided_json": "output_format"},
    ranges={"temperature": Range(0, 1)},
)


def with_output_limit(api: ApiFields, field: str) -> ApiFields:
    """The API's fields, the output limit named as the request gave it, unless the API has one name for it."""
    if "max_tokens" in api.names:
        return api
    return replace(api, names={**api.names, "max_tokens": field})
