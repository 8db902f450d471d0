"""Prompt logprobs (vLLM's prompt_logprobs) against transformers' log-softmax on the same weights: a prompt longer
than one prefill chunk, a prompt whose blocks are in the prefix cache, n > 1, and a greedy run beside; and
allowed_token_ids, which keeps sampling to the tokens it names."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.sampling_params import InvalidParameter
from tests.backend.conftest import prompts_of_lengths


def _reference(hf_model, directory, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(directory)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1


def _assert_matches(entries, prompt: list[int], reference: torch.Tensor, top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        row, token = reference[p - 1], prompt[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        best = torch.topk(row, top).indices.tolist()
        assert set(best) <= set(entry) and len(entry) <= top + 1
        assert [entry[t].rank for t in best] == list(range(1, top + 1))


def test_prompt_logprobs_match_transformers_across_chunks_and_from_the_prefix_cache(tiny_dir, hf_model):
    directory = tiny_dir("llama")
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=16)  # a 45-token prompt takes three chunks
    prompt, other = prompts_of_lengths(45, 20)
    reference = _reference(hf_model, directory, prompt)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)

    first = llm.generate(prompt, params, use_tqdm=False)[0]
    _assert_matches(first.prompt_logprobs, prompt, reference, 2)
    assert first.prompt_logprobs[1][prompt[1]].decoded_token == llm.get_tokenizer().decode([prompt[1]])

    # Cached now (and cached again by a request that does not ask): the same numbers, every row computed again.
    # Beside a decoding sequence the step budget may cut the prompt into other chunks (sized by measured time), and
    # attention summed over other chunk edges rounds differently: the same tokens, values within float32 rounding.
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    again, beside = llm.generate([prompt, other], [params, SamplingParams(temperature=0, max_tokens=5)],
                                 use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs[0] is None and len(again.prompt_logprobs) == len(first.prompt_logprobs)
    for e, f in zip(again.prompt_logprobs[1:], first.prompt_logprobs[1:]):
        assert e.keys() == f.keys() and all(abs(e[t].logprob - f[t].logprob) < 1e-5 for t in e)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and beside.prompt_logprobs is None

    # n > 1 shares one prompt: one list; a 1-token prompt has only the None entry
    several = llm.generate(prompt, SamplingParams(n=2, temperature=1, seed=3, max_tokens=2, prompt_logprobs=0),
                           use_tqdm=False)[0]
    _assert_matches(several.prompt_logprobs, prompt, reference, 0)
    assert llm.generate([7], params, use_tqdm=False)[0].prompt_logprobs == [None]


def test_allowed_token_ids_keep_sampling_to_them(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8)
    prompt = prompts_of_lengths(9)[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    allowed = [t for t in (11, 12, 13) if t not in greedy[:1]]
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, seed=1, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)):
        tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens and set(tokens) <= set(allowed)
    with pytest.raises(InvalidParameter, match="token id 5000 is not in the vocabulary"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[5000]), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
