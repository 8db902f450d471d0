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
# DeepSeek's latent attention (4 heads, a 32-wide latent, 8 rotary dimensions), routed and shared experts
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           moe_intermediate_size=24, num_experts_per_tok=2)
# DeepSeek-V3's YaRN, mscale and mscale_all_dim apart so that both count (the rotary table and the softmax scale)
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# V3's and GLM-4.5's router: 8 experts in 4 groups, the best 2 groups kept, sigmoid scores with a drawn bias
GROUPED = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=24,
               first_k_dense_replace=1, num_hidden_layers=3, norm_topk_prob=True, routed_scaling_factor=2.5)

# name -> (transformers config class, model class, config overrides)# Hybrid linear attention: three Gated DeltaNet layers to one gated full-attention layer; value heads twice the key
# heads (each key head serving two), a quarter of each full-attention head rotating
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2)
# gpt-oss: a 12-token window on every other layer (shorter than the test prompts), sinks, YaRN, a SwiGLU limit low
# enough that the clamp acts; its biases and sinks drawn (build_model)
GPT_OSS = dict(num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
               swiglu_limit=1.5, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 64})

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
    # DeepSeek-V2-Lite's shape: q in one projection, softmax top-k (not renormalised), two shared experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_routed_experts=4, n_shared_experts=2, topk_method="greedy", **MLA)),
    # DeepSeek-V2's group-limited router (the best expert of each of 4 groups, 2 groups kept), a dense first layer
    "deepseek_v2_grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_shared_experts=1, topk_method="group_limited_greedy",
        **{**MLA, **GROUPED, "norm_topk_prob": False, "routed_scaling_factor": 1.5})),
    # DeepSeek-V3's shape: q through its low-rank path, the sigmoid router with its bias, YaRN with mscale
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=24, n_shared_experts=1, rope_parameters=V3_YARN, **{**MLA, **GROUPED})),
    # GLM-4.5's: V3's router over grouped-query attention, half of each head rotating, q/k norms, q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, use_qk_norm=True, attention_bias=True, n_shared_experts=1, **GROUPED)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(mlp_only_layers=[1], **HYBRID)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
}
# Families whose RMSNorms scale by (1 + weight), the weights starting at 0: drawn, so that each norm counts
UNIT_OFFSET_NORMS = ("Gemma3TextConfig", "Qwen3NextConfig", "Qwen3_5MoeTextConfig")


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
    if config_cls in UNIT_OFFSET_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    with torch.no_grad():  # the routers' selection bias starts at 0: drawn, so that it changes the choice
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    if config_cls == "GptOssConfig":  # its biases start at 0 and its sinks near it: drawn, so that each counts
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 1.0 if param_name.endswith("sinks") else 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    build_tokenizer(directory, chat_template)
    return directory


def build_gemma3_multimodal(directory: Path, seed: int = 0) -> Path:
    """Gemma3ForConditionalGeneration: GEMMA3's text model beside a one-layer SigLIP tower and its projector (image
    tokens past the text's), saved as transformers saves it, the end tokens at the top level as the releases give
    them; its (1 + w) norms drawn."""
    import transformers

    text = transformers.Gemma3TextConfig(**{**COMMON, **GEMMA3})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=509, eoi_token_index=510, image_token_index=511,
                                       eos_token_id=[2, 5])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    build_tokenizer(directory)
    return directory
