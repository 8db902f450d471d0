"""How many of an output's tokens the model spent reasoning: OpenAI's `reasoning_tokens` (chat completions'
`completion_tokens_details`, Responses' `output_tokens_details`).

Counted on the token ids, where each format's markers are one token each: a think block's tokens through its
`</think>` (the opening `<think>` too when the output writes it), and every harmony message on the `analysis`
channel, header and closing marker included. Where a marker is not one token in the vocabulary the count is 0,
as it is for output without reasoning.
"""

from backend.server.harmony import CHANNEL, ENDS, MESSAGE
from backend.server.reasoning import think_marker_ids


def _single_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _think_tokens(tokenizer, ids: list[int], in_thinking: bool) -> int:
    markers = think_marker_ids(tokenizer)
    if markers is None:
        return 0
    open_id, close_id = markers
    if not in_thinking:
        lead = next((i for i, t in enumerate(ids) if tokenizer.decode([t]).strip()), None)
        if lead is None or ids[lead] != open_id:
            return 0  # no think block opens the output: it is all answer
    return ids.index(close_id) + 1 if close_id in ids else len(ids)


def _harmony_tokens(tokenizer, ids: list[int]) -> int:
    channel_id, message_id = _single_id(tokenizer, CHANNEL), _single_id(tokenizer, MESSAGE)
    end_ids = {_single_id(tokenizer, end) for end in ENDS} - {None}
    if channel_id is None or message_id is None or not end_ids:
        return 0
    total, start = 0, 0
    for at in [i for i, t in enumerate(ids) if t in end_ids] + [len(ids)]:
        message = ids[start:at + 1]
        if channel_id in message and message_id in message:
            header = message[message.index(channel_id) + 1:message.index(message_id)]
            if tokenizer.decode(header).strip().startswith("analysis"):
                total += len(message)
        start = at + 1
    return total


def reasoning_tokens(fmt: str | None, in_thinking: bool, tokenizer, ids: list[int]) -> int:
    """The tokens of `ids` (one choice's output) that are its reasoning, in reasoning format fmt."""
    if fmt == "think":
        return _think_tokens(tokenizer, ids, in_thinking)
    if fmt == "harmony":
        return _harmony_tokens(tokenizer, ids)
    return 0
