"""The tokenizer a GGUF model runs with (backend.plain_tokenizer: tokenizers + jinja2, no transformers) against
transformers' tokenizer converted from the same file, the oracle: ids, text, special tokens, chat templates,
xgrammar's vocabulary; and a start that never imports transformers."""

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch

from backend.chat_template import render
from backend.loader import load_tokenizer, locate
from backend.plain_tokenizer import PlainTokenizer
from tests.backend.tiny_models import TOOLS_CHAT_TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello world", " leading space", "Tabs\tand\nnewlines\n\n  x", "unicode: café 日本語 🚀 Ünïcödé",
         "1234567 + 89 = 0.5?", "don't you're I'm WE'LL", "a  b   c    ", "", "<|im_start|>user\nhi<|im_end|>",
         "<s>[INST] hi [/INST]</s>", "def f(x):\n    return {'k': [1, 2]}\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3 — in français?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Zürich?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
              {"role": "tool", "content": "{\"temp\": 4}"}]
# What templates use beyond messages: namespaces, loop controls, generation blocks, reasoning under its
# three names, tojson's options, strftime_now, the special tokens, extra variables.
FEATURES_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m.role }}]{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% endfor %}{{ tools | tojson(indent=2, sort_keys=true) }}{{ dict(a=1) | tojson }}{{ strftime_now('%Y') }}"
    "{{ eos_token }}{% if add_generation_prompt %}<gen {{ flavour }}>{% endif %}"
)
# The OpenAI SDK's dumps carry keys set to None; templates test for the keys (Llama 3: 'tool_calls' in message)
NONE_TURNS = [{"role": "user", "content": "Weather in Zürich?", "name": None, "tool_calls": None},
              {"role": "assistant", "content": None, "tool_calls": TOOL_TURNS[1]["tool_calls"]},
              {"role": "tool", "content": "{\"temp\": 4}", "tool_call_id": None}]
NONE_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if 'tool_calls' in m %}{{ m.tool_calls | length }} call(s) "
                 "{% endif %}{{ m['content'] | trim }}|{% endfor %}")
FEATURE_TURNS = [{"role": "user", "content": "q"}, {"role": "skip", "content": "x"},
                 {"role": "assistant", "content": "a", "reasoning": "because ü"},
                 {"role": "assistant", "content": "b", "thinking": "t"}]


def _pair(path: Path, home: Path):
    """(ours, transformers' tokenizer converted from the same GGUF file)."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(locate(str(path)))
    return ours, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module", params=["smollm2", "llama", "qwen2"])
def pair(request, tiny_gguf, smollm2_path, tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("home")
    monkeypatch_module.setenv("SCRIPTORIUM_HOME", str(home))
    path = smollm2_path if request.param == "smollm2" else tiny_gguf(request.param)[0]
    return _pair(Path(path), home)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_ids_and_text_are_transformers(pair):
    ours, theirs = pair
    assert isinstance(ours, PlainTokenizer)
    for text in TEXTS:
        for add in (True, False):
            assert ours(text, add_special_tokens=add).input_ids == theirs(text, add_special_tokens=add).input_ids
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)
        ids = theirs(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours(TEXTS).input_ids == theirs(TEXTS).input_ids  # a batch
    assert ours.batch_decode(theirs(TEXTS).input_ids) == theirs.batch_decode(theirs(TEXTS).input_ids)
    assert [ours.tokenize(t) for t in TEXTS] == [theirs.tokenize(t) for t in TEXTS]
    every = list(range(len(theirs)))
    assert ours.decode(every) == theirs.decode(every) == ours.decode(torch.tensor(every))
    assert [ours.decode(t) for t in every] == [theirs.decode([t]) for t in every]
    assert ours.convert_ids_to_tokens(every) == theirs.convert_ids_to_tokens(every)


def test_special_tokens_are_transformers(pair):
    ours, theirs = pair
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.all_special_tokens, ours.all_special_ids) == (theirs.all_special_tokens, theirs.all_special_ids)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token"):
        assert (getattr(ours, name), getattr(ours, name + "_id")) == (getattr(theirs, name), getattr(theirs, name + "_id"))
    assert ours.add_bos_token == (theirs("x").input_ids[:1] == [theirs.bos_token_id])
    assert ours.convert_tokens_to_ids(["<no such token>", theirs.eos_token]) == \
        theirs.convert_tokens_to_ids(["<no such token>", theirs.eos_token])
    with pytest.raises(AttributeError):
        assert ours.no_such_attribute is None  # never reached


@pytest.mark.parametrize("template", [None, TOOLS_CHAT_TEMPLATE, FEATURES_TEMPLATE, NONE_TEMPLATE])
def test_chat_templates_render_as_transformers(pair, template):
    ours, theirs = pair
    cases = [(c, None) for c in CONVERSATIONS] + [(TOOL_TURNS, TOOLS), (FEATURE_TURNS, TOOLS), (NONE_TURNS, TOOLS)]
    def outcome(tok, messages, **kwargs):  # the text, or what the template raised (SmolLM2's needs content)
        try:
            return tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except jinja2.TemplateError as e:
            return type(e).__name__

    for messages, tools in cases:
        for gen in (True, False):
            kwargs = dict(chat_template=template, tools=tools, add_generation_prompt=gen, flavour="ü")
            text = outcome(ours, messages, **kwargs)
            assert text == outcome(theirs, messages, **kwargs)
            if messages is not NONE_TURNS or template is not None:
                assert ours.apply_chat_template(messages, **kwargs).input_ids == \
                    theirs.apply_chat_template(messages, **kwargs)["input_ids"]
    assert "<think>because ü|because ü</think>" in render(FEATURES_TEMPLATE, FEATURE_TURNS, tools=None)
    assert render(NONE_TEMPLATE, NONE_TURNS) == "user:Weather in Zürich?|assistant:1 call(s) |tool:{\"temp\": 4}|"


def test_what_only_transformers_does_is_refused_by_name(pair):
    ours, _ = pair
    with pytest.raises(NotImplementedError, match="continue_final_message"):
        ours.apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match="empty"):
        ours.apply_chat_template([], tokenize=False)


def test_template_refusals_and_sandbox_are_transformers(pair):
    ours, theirs = pair
    refusing = "{% if messages[0].role != 'system' %}{{ raise_exception('system first, please') }}{% endif %}"
    for tok in (ours, theirs):
        with pytest.raises(jinja2.TemplateError, match="system first, please"):
            tok.apply_chat_template(CONVERSATIONS[0], chat_template=refusing, tokenize=False)
    escapes = ["{% set ns = namespace(_x=1) %}", "{{ messages[0].__class__.mro() }}", "{{ ''.format.__globals__ }}",
               "{{ dict.__init__ }}{{ raise_exception.__globals__ }}", "{% set d = dict(a=1) %}{{ d.update(b=2) }}"]
    for escape in escapes:
        outcomes = []
        for tok in (ours, theirs):
            try:
                outcomes.append(tok.apply_chat_template(CONVERSATIONS[0], chat_template=escape, tokenize=False))
            except Exception as e:
                outcomes.append(type(e).__name__)
        assert outcomes[0] == outcomes[1], escape
        assert outcomes[0] in ("SecurityError", "UndefinedError", ""), (escape, outcomes)

def test_grammar_vocabulary_is_xgrammar_from_huggingface(pair):
    import xgrammar

    from backend.engine.guided import grammar_tokenizer_info

    ours, theirs = pair
    vocab = len(theirs) + 3  # a model's vocabulary padded past the tokenizer's
    mine = grammar_tokenizer_info(xgrammar, ours, vocab)
    reference = xgrammar.TokenizerInfo.from_huggingface(theirs, vocab_size=vocab)
    assert (mine.vocab_type, mine.add_prefix_space, mine.vocab_size, mine.stop_token_ids) == \
        (reference.vocab_type, reference.add_prefix_space, reference.vocab_size, reference.stop_token_ids)
    assert mine.decoded_vocab == reference.decoded_vocab


def test_a_warm_start_never_imports_transformers(tiny_gguf, tmp_path):
    """The second start of a GGUF model (its tokenizer converted by the first) runs without transformers,
    and tokenizes as the first did."""
    path, _ = tiny_gguf("qwen2")
    script = ("import json, sys; from backend import LLM; llm = LLM(sys.argv[1], max_model_len=256); "
              "print(json.dumps([llm.tokenizer('1234567 + 89').input_ids, 'transformers' in sys.modules]))")
    env = {"SCRIPTORIUM_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True, timeout=300).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] is True and runs[1][1] is False  # the first converts with transformers, the second not
