"""EngineArgs: the settings of nano-vllm-style step-wise engines (the Nano-vLLM-MS walkthrough's names),
turned into this engine's EngineConfig, and checked against the model file before any weight is loaded.

Its fields are the walkthrough's own below, then every other EngineConfig field as config.py declares it (name,
type, default), so a setting added there is an EngineArgs field too."""

from dataclasses import field, fields, make_dataclass

from backend.config import EngineConfig
from backend.config_flags import engine_fields
from backend.model_config import ModelConfig

# quantization as those engines spell it -> EngineConfig.quantization
QUANTIZATION = {None: None, "gguf": None, "dequantize": "dequantize", "int8": "int8", "int4": "int4"}

WALKTHROUGH_FIELDS = [
    ("model", str),
    ("tensor_parallel_size", int, field(default=1)),
    # "gguf": a GGUF file, kept quantized; "int8"/"int4": an HF checkpoint (QUANTIZATION)
    ("quantization", str | None, field(default=None)),
    ("moe_num_experts", int | None, field(default=None)),  # when given, must be the file's
    ("moe_top_k", int | None, field(default=None)),  # when given, must be the file's
    # a draft model, of any vocabulary (spec/vocab_bridge.py)
    ("speculative_model", str | None, field(default=None)),
    ("speculative_draft_length", int, field(default=5)),
    # MoE: experts that do not fit stay in host memory (moe_gpu_experts=auto)
    ("enable_cpu_offload", bool, field(default=False)),
]


def create_engine_config(self) -> EngineConfig:
    if self.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={self.tensor_parallel_size}: this engine runs a model on one "
            "GPU; for tensor parallelism across several GPUs run vLLM (SCRIPTORIUM_ENGINE=vllm in "
            "the stack, or `vllm serve MODEL --tensor-parallel-size N`) behind the same OpenAI API"
        )
    if self.quantization not in QUANTIZATION:
        raise ValueError(
            f"quantization {self.quantization!r} is not supported; use one of "
            f"{', '.join(repr(q) for q in QUANTIZATION)}"
        )
    if self.quantization == "gguf" and not self.model.endswith(".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf file as the model, got {self.model!r}")
    if self.enable_cpu_offload and self.moe_gpu_experts not in (None, "auto"):
        raise ValueError(
            "enable_cpu_offload=True chooses moe_gpu_experts='auto'; it cannot be combined "
            f"with moe_gpu_experts={self.moe_gpu_experts!r}"
        )
    speculative = self.speculative
    if self.speculative_model is not None:
        if speculative is not None:
            raise ValueError(
                "speculative_model and speculative both say how to decode speculatively; give one"
            )
        speculative = {
            "method": "draft",
            "model": self.speculative_model,
            "num_tokens": self.speculative_draft_length,
        }
    # the settings both spell alike pass as they are; the walkthrough's own names are translated
    alike = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
    return EngineConfig(
        **{
            **alike,
            "speculative": speculative,
            "quantization": QUANTIZATION[self.quantization],
            "moe_gpu_experts": "auto" if self.enable_cpu_offload else self.moe_gpu_experts,
        }
    )


def check_model(self, config: ModelConfig) -> None:
    """moe_num_experts / moe_top_k, when given, are what the file says; a mismatch names both."""
    for name, given, actual in (
        ("moe_num_experts", self.moe_num_experts, config.num_experts),
        ("moe_top_k", self.moe_top_k, config.num_experts_per_tok),
    ):
        if given is not None and given != actual:
            what = f"the model has {actual}" if config.is_moe else "the model is dense (no experts)"
            raise ValueError(
                f"{name}={given} does not match {self.model}: {what}; leave {name} unset "
                f"or set it to {actual}"
            )


EngineArgs = make_dataclass(
    "EngineArgs",
    [*WALKTHROUGH_FIELDS, *engine_fields(leave_out=tuple(name for name, *_ in WALKTHROUGH_FIELDS))],
    namespace={
        "create_engine_config": create_engine_config,
        "check_model": check_model,
        "__module__": __name__,
    },
)
