"""Admission in turns by client, then by request within a client, and each client's share of the slots: one
agent's many requests cannot take every slot or push another agent's request behind all of theirs."""

from starlette.requests import Request

from backend import SamplingParams
from backend.engine.admission import AdmittedRequest
from backend.engine.sequence import Sequence
from backend.engine.step_budget import max_seqs_per_client
from backend.engine.wait_queue import WaitQueue
from backend.llm import LLM
from backend.server.client_id import client_id
from backend.server.messages_shapes import MessagesRequest
from backend.server.protocol import ChatRequest
from tests.backend.conftest import prompts_of_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _seq(seq_id: int, request_id: str, client: str | None = None, group: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=request_id, index=0, token_ids=[1], num_prompt_tokens=1,
                    params=SamplingParams(), group=group, client=client)


def test_turns_go_by_client_then_by_request():
    queue = WaitQueue()
    a_many = [_seq(i, f"a-many-{i}", "a", group="a-many") for i in range(3)]
    a_single = [_seq(10 + i, f"a-{i}", "a") for i in range(2)]
    b = _seq(20, "b", "b")
    anonymous = _seq(30, "anon")  # no client: a client of its own request, as before clients had turns
    for seq in [*a_many, *a_single, b, anonymous]:
        queue.add(seq)
    order = [queue.pop() for _ in range(len(queue))]
    assert order == [a_many[0], b, anonymous, a_single[0], a_single[1], a_many[1], a_many[2]]
    # within a client, its requests take turns too: the completion's prompts do not all go first
    assert order.index(a_single[0]) < order.index(a_many[1])


def test_one_client_holds_at_most_its_share_and_a_late_client_starts(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8, max_num_seqs=4)
    engine = llm.engine
    share = max_seqs_per_client(4)
    for i, prompt in enumerate(prompts_of_lengths(*range(10, 18))):  # eight separate requests of one client
        engine.add_request(f"a-{i}", AdmittedRequest(prompt, GREEDY, client="agent-a"))
    engine.step()
    held = [s for s in engine.scheduler.running if s.client == "agent-a"]
    assert len(held) == share < 4  # one slot stays for other clients, though a's requests are separate
    engine.add_request("b", AdmittedRequest(prompts_of_lengths(12)[0], GREEDY, client="agent-b"))
    engine.step()
    assert any(s.request_id == "b" for s in engine.scheduler.running)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _request(headers: dict[str, str], host: str = "127.0.0.1") -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": (host, 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope)


def test_the_client_is_the_named_user_else_the_agent_and_address():
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    claude = _request({"User-Agent": "claude-cli/2.1.197 (external, sdk-cli)"})
    codex = _request({"User-Agent": "codex_exec/0.171.0"})
    assert client_id(claude, chat) != client_id(codex, chat)
    assert client_id(claude, chat) == client_id(_request({"User-Agent": "claude-cli/2.1.197 (external, sdk-cli)"}),
                                                chat)
    assert client_id(claude, chat) != client_id(_request({"User-Agent": "claude-cli/2.1.197 (external, sdk-cli)"},
                                                         "10.0.0.2"), chat)
    named = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "u1"})
    assert client_id(claude, named) == client_id(codex, named) == "user:u1"
    keyed = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "prompt_cache_key": "conversation-7"})
    assert client_id(codex, keyed) == "user:conversation-7"
    session = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user",
                                              "content": "hi"}], "metadata": {"user_id": "user_abc_session_1"}})
    assert client_id(claude, session) == "user:user_abc_session_1"
