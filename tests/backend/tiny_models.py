"""Tiny random-weight checkpoints of every supported family, built from transformers' own config classes."""

import zlib
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen 2.5's template, which knows tools: functions in the system message, calls in <tool_call> tags.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each "
    "function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:"
    "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' "
    "and not message.tool_calls) %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}\n<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CORPUS = [
    "The scribe copied the manuscript by candlelight, line after line, while the apprentice mixed the ink.",
    "A quick apprentice drafts, a slow master verifies; together they write the same text faster.",
    "Paged attention keeps the cache in blocks; prefix caching shares blocks between requests.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } \" ' - _ / \\ # @ & * + = < > ~",
] * 20

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0, attention_multiplier=0.015)
# Gemma 3: sliding layers (a 12-token window, shorter than the test prompts) around full ones, each kind with its
# own rotary base (the full layers' linearly scaled), q . k scaled by a query_pre_attn_scalar other than head_dim
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
GEMMA3 = dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, rope_parameters=GEMMA3_ROPE)

# name -> (transformers config class, model class, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80, mlp_only_layers=[1], **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32, **MOE)),
    # Four layers: the fourth is NoPE (no_rope_layer_interval 4, the default)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4)),
    # NoPE layers named one by one, and sliding windows on them (transformers' layer_types for use_sliding_window)
    "smollm3_nope_windows": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=3, no_rope_layers=[0, 1, 0], use_sliding_window=True, sliding_window=12)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=24)),
    # Phi-4-mini's shape: half of each head rotates, tied embeddings, no window
    "phi4_partial_rotary": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, tie_word_embeddings=True)),
    # q/k RMSNorm over the whole projection (4 heads of q: per head would differ), top-k not renormalised
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, **MOE)),
    # Multipliers far from 1, so that ignoring any one of them changes the logits (test_moe_families.py)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, **GRANITE, **MOE)),
    "granitemoe_shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, shared_intermediate_size=80, **GRANITE, **MOE)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
}


def build_tokenizer(directory: Path, chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return fast


def build_model(name: str, directory: Path, seed: int | None = None, chat_template: str = CHAT_TEMPLATE,
                **extra) -> Path:
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **extra})
    torch.manual_seed(zlib.crc32(name.encode()) if seed is None else seed)
    model = getattr(transformers, model_cls)(config).eval()
    if config_cls == "Gemma3TextConfig":  # its norms start at 0 (a scale of 1 + 0): drawn, so each one counts
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    build_tokenizer(directory, chat_template)
    return directory
