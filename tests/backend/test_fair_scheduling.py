"""Admission in turns by request, prompt chunks that leave decoding sequences their token, and embedding
inputs scheduled as prompt chunks that are never sampled from."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.block_manager import BlockManager
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence, Status
from backend.engine.step_budget import StepBudget
from backend.engine.wait_queue import WaitQueue
from backend.sampling_params import InvalidParameter
from tests.backend.conftest import prompts_of_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _seq(seq_id: int, request_id: str, tokens: list[int], group: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=request_id, index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams(), group=group)


def test_wait_queue_takes_one_sequence_of_each_request_in_turn():
    queue = WaitQueue()
    many = [_seq(i, f"many-{i}", [1], group="many") for i in range(5)]
    for seq in many:
        queue.add(seq)
    single = _seq(9, "single", [1])
    queue.add(single)
    preempted = _seq(10, "old", [1])
    queue.add_first(preempted)
    assert len(queue) == 7 and queue.peek() is preempted
    order = [queue.pop() for _ in range(3)]
    assert order == [preempted, many[0], single]  # the later request waited one turn, not five
    assert queue.remove(many[3]) and not queue.remove(many[3])
    assert [queue.pop() for _ in range(len(queue))] == [many[1], many[2], many[4]] and not queue


def test_a_request_of_many_prompts_cannot_push_a_later_one_behind_all_of_them(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8, max_num_seqs=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts_of_lengths(*range(10, 30))):
        engine.add_request(f"many-{i}", prompt, GREEDY, group="many")
    engine.add_request("single", prompts_of_lengths(12)[0], GREEDY)
    while not any(out.request_id == "single" and out.outputs[0].token_ids for out in engine.step()):
        pass
    # In one queue it would have waited for all 20; in turns the many had at most one turn more than it.
    many_started = 20 - sum(1 for s in engine.scheduler.waiting if s.request_id.startswith("many"))
    assert many_started <= 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_chunk_leaves_a_token_for_each_decoding_sequence_behind_it():
    bm = BlockManager(num_blocks=64, block_size=8)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    prefilling = _seq(0, "long", list(range(3, 103)))
    decoding = [_seq(1 + i, f"d{i}", [5, 6, 7, 8, 9]) for i in range(3)]
    for seq in [prefilling, *decoding]:
        assert bm.allocate(seq, [], [], seq.num_tokens)
        seq.status = Status.RUNNING
        scheduler.running.append(seq)
    for seq in decoding:  # their prompts computed but the last token: they decode
        seq.num_computed_tokens = seq.num_tokens - 1
    plan = scheduler.schedule()
    assert [(item.seq.request_id, item.num_scheduled_tokens) for item in plan] == [("long", 13), ("d0", 1), ("d1", 1),
                                                                           ("d2", 1)]


def _running(scheduler: Scheduler, seq: Sequence) -> Sequence:
    assert scheduler.block_manager.allocate(seq, [], [], seq.num_tokens)
    seq.status = Status.RUNNING
    scheduler.running.append(seq)
    return seq


def _planned(scheduler: Scheduler) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_scheduled_tokens) for item in scheduler.schedule()]


def test_a_prompt_alone_takes_the_whole_step_and_a_new_request_starts_in_the_next_one():
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=8), max_num_seqs=8, max_num_batched_tokens=64,
                          step_budget=StepBudget(0.25, first_guess=64))
    running = _running(scheduler, _seq(0, "long", list(range(3, 203))))
    assert _planned(scheduler) == [("long", 64)]  # nothing else runs or waits: the whole budget
    running.num_computed_tokens += 64
    scheduler.add(_seq(1, "new0", list(range(3, 43))))
    # The new request starts now, beside the long prompt (in one queue it waited for the prompt's end); the two
    # share the step's prompt tokens, half of them kept for the newcomer.
    assert _planned(scheduler) == [("long", 32), ("new0", 32)]


def test_while_a_sequence_decodes_the_prompt_chunks_of_a_step_stay_within_the_prefill_threshold():
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=8), max_num_seqs=8, max_num_batched_tokens=64,
                          max_prompt_tokens_while_decoding=10)
    running = _running(scheduler, _seq(0, "long", list(range(3, 103))))
    running.num_computed_tokens = running.num_tokens - 1  # it decodes
    for i in range(2):
        scheduler.add(_seq(1 + i, f"new{i}", list(range(3, 43))))
    # both start at once, sharing the threshold's tokens (before, new0 took all ten and new1 waited a step)
    assert _planned(scheduler) == [("long", 1), ("new0", 5), ("new1", 5)]
    for seq in scheduler.running[1:]:
        seq.num_computed_tokens += 5
    assert _planned(scheduler) == [("long", 1), ("new0", 5), ("new1", 5)]


def test_a_short_prompt_beside_a_long_one_is_not_held_back_by_the_smallest_chunk():
    """At the smallest step (32 prompt tokens: expensive tokens, or a loaded machine) the long prompt first in line
    used to take all 32 every step once the newcomer's first chunk had run, so the newcomer's last 4 tokens waited
    for the long prompt's end."""
    scheduler = Scheduler(BlockManager(num_blocks=128, block_size=8), max_num_seqs=8, max_num_batched_tokens=64,
                          step_budget=StepBudget(0.25, first_guess=32))
    long = _running(scheduler, _seq(0, "long", list(range(3, 603))))
    long.num_computed_tokens = 64
    scheduler.add(_seq(1, "new0", list(range(3, 23))))
    assert _planned(scheduler) == [("long", 16), ("new0", 16)]
    long.num_computed_tokens += 16
    scheduler.running[1].num_computed_tokens += 16
    assert _planned(scheduler) == [("long", 28), ("new0", 4)]


def test_long_prompts_under_way_share_the_prompt_tokens_in_equal_parts():
    scheduler = Scheduler(BlockManager(num_blocks=128, block_size=8), max_num_seqs=8, max_num_batched_tokens=256,
                          max_prompt_tokens_while_decoding=96)
    decoding = _running(scheduler, _seq(0, "stream", list(range(3, 13))))
    decoding.num_computed_tokens = decoding.num_tokens - 1
    for i in range(3):
        _running(scheduler, _seq(1 + i, f"long{i}", list(range(3, 303))))
    assert _planned(scheduler) == [("stream", 1), ("long0", 32), ("long1", 32), ("long2", 32)]


def test_one_request_leaves_a_quarter_of_the_slots_to_others():
    scheduler = Scheduler(BlockManager(num_blocks=128, block_size=8), max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(12):
        scheduler.add(_seq(i, f"many-{i}", [3, 4, 5], group="many"))
    assert len(scheduler.schedule()) == 6  # 8 slots, 2 kept
    scheduler.add(_seq(20, "probe", [3, 4, 5]))
    assert _planned(scheduler)[-1] == ("probe", 3)  # it starts at once, though "many" still waits


def test_the_step_budget_sizes_prompt_work_from_the_measured_cost_of_a_token():
    budget = StepBudget(target=0.25, first_guess=256)
    assert budget.prompt_tokens(busy=True, cap=2048) == 256 and budget.prompt_tokens(busy=False, cap=2048) == 256
    budget.observe(0, 0.05)  # a step without prompt work says nothing of a token's cost
    budget.observe(100, 0.15)  # a fixed 50 ms and 1 ms a prompt token
    # one size so far: every second counted against the tokens (1.5 ms each), a size that keeps within the target
    assert budget.prompt_tokens(busy=True, cap=2048) == 167
    budget.observe(200, 0.25)
    assert budget.cost() == pytest.approx((0.05, 0.001))
    assert budget.prompt_tokens(busy=True, cap=2048) == 200  # (250 - 50) ms at 1 ms a token
    # alone: four times the target (950 tokens), but no more than twice the largest size measured
    assert budget.prompt_tokens(busy=False, cap=2048) == 400
    assert budget.prompt_tokens(busy=True, cap=100) == 100
    stuck = StepBudget(target=0.25, first_guess=32)
    stuck.observe(32, 2.0)  # a loaded machine: 32 tokens took longer than even a prompt alone may
    assert stuck.prompt_tokens(busy=True, cap=2048) == 8  # beside streams, the smallest chunk
    assert stuck.prompt_tokens(busy=False, cap=2048) == 64  # alone: twice the tokens, so that the fit can start
    stuck.observe(64, 3.0)
    assert stuck.cost() == pytest.approx((1.0, 1 / 32))


def test_deep_in_a_long_prompt_a_step_beside_streams_takes_fewer_tokens_than_a_prompt_alone_would():
    """Far into a 30k prompt a token costs ~24 ms (its attention reads every key before it): 32 tokens a step would
    hold the streams' next tokens for 0.78 s, three times the target."""
    budget = StepBudget(target=0.25, first_guess=32)
    for n in (16, 32):
        budget.observe(n, 0.01 + 0.024 * n)
    assert budget.prompt_tokens(busy=True, cap=2048) == 10  # (250 - 10) ms at 24 ms a token
    assert budget.prompt_tokens(busy=False, cap=2048) == 41  # alone, four times the target


def test_a_step_grows_at_most_twice_the_largest_size_measured():
    """Beside many decode rows a few prompt tokens barely change a step's time: the fitted slope is near 0, and
    (target - fixed) / slope would promise thousands of prompt tokens in one step."""
    budget = StepBudget(target=0.25, first_guess=32)
    budget.observe(4, 0.2)
    budget.observe(8, 0.2001)
    assert budget.cost()[1] == pytest.approx(0.000025)
    assert budget.prompt_tokens(busy=True, cap=8192) == 16


def test_tokens_that_got_dearer_shrink_the_next_step():
    budget = StepBudget(target=0.25, first_guess=256)
    for n in (100, 200):
        budget.observe(n, 0.05 + 0.001 * n)
    for n in (200, 300):  # tokens got dearer (a longer context, or the cores taken): 2 ms a token
        budget.observe(n, 0.05 + 0.002 * n)
    assert budget.prompt_tokens(busy=True, cap=2048) < 200


def test_embedding_inputs_run_as_chunks_beside_a_generation_and_free_their_blocks(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8, max_num_batched_tokens=16)
    engine = llm.engine
    inputs = prompts_of_lengths(40, 7, 33)
    engine.add_embedding_request("alone", inputs)
    alone = _run(engine)["alone"].embeddings

    engine.add_request("gen", prompts_of_lengths(5)[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # its prompt
    engine.add_embedding_request("beside", inputs)
    planned = []
    schedule = engine.scheduler.schedule

    def recording(drafts=None):
        plan = schedule(drafts)
        planned.append([(item.seq.request_id, item.num_scheduled_tokens) for item in plan])
        return plan

    engine.scheduler.schedule = recording
    beside = _run(engine, until="beside")["beside"].embeddings
    assert all(sum(n for _, n in plan) <= 16 and ("gen", 1) in plan for plan in planned)  # a token every step
    assert len(planned) >= sum(len(i) for i in inputs) // 16  # in chunks, never all at once
    for a, b in zip(alone, beside):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert a.norm().item() == pytest.approx(1.0, abs=1e-5)

    engine.add_embedding_request("left", inputs)
    engine.step()
    engine.abort_request("left")
    _run(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_embeddings_request_over_its_token_limit_is_refused_naming_it(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8, max_model_len=64, max_embedding_tokens=100)
    with pytest.raises(InvalidParameter, match="at most 100 tokens per request .max_embedding_tokens.") as e:
        llm.engine.add_embedding_request("big", prompts_of_lengths(60, 60))
    assert e.value.param == "input" and not llm.engine.has_unfinished_requests()


def _run(engine, until: str | None = None) -> dict:
    """Step until `until` finished (or everything); the finished deltas by request."""
    done = {}
    while engine.has_unfinished_requests() and (until is None or until not in done):
        for delta in engine.step_deltas():
            if delta.finished:
                done[delta.request_id] = delta
    return done
