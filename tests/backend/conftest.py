import os
import platform
from pathlib import Path

import openai
import pytest
import torch

# Tests that send CPU tensors through the Triton kernels (SCRIPTORIUM_TRITON=1) need the interpreter, which
# tests/conftest.py turns on only without a GPU; with one, the CUDA tests run the same kernels compiled.
interpreted_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="runs the CUDA path's kernels on CPU tensors: needs TRITON_INTERPRET=1")
KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def on_kernel_device(fn, *args, **kwargs):
    """fn (a Triton kernel's wrapper) where the kernels run: compiled on the GPU, or interpreted on the CPU.
    Tensor arguments are moved there and the results brought back, to compare with CPU references."""
    def there(v):
        return v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v

    out = fn(*map(there, args), **{k: there(v) for k, v in kwargs.items()})
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(directory) -> the transformers model loaded from it, in fp32, cached."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(directory: Path):
        if directory not in cache:
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # compare fixed-length continuations
            cache[directory] = model
        return cache[directory]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(family, variant=None, **options) -> (GGUF file, reference directory), built once."""
    from tests.backend.tiny_gguf import build_family, write_gguf

    root = tmp_path_factory.mktemp("tiny-gguf")
    built = {}

    def get(family: str, variant: str | None = None, build: dict | None = None, **options):
        key = (family, variant)
        if key not in built:
            name = family + (f"-{variant}" if variant else "")
            hf = build_family(family, root / name, **(build or {}))
            built[key] = write_gguf(family, hf, root / f"{name}.gguf", **options)
        return built[key]

    return get


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def prompts_of_lengths(*lengths: int, vocab: int = 400) -> list[list[int]]:
    """Deterministic token-id prompts; lengths chosen by tests to cross block boundaries."""
    return [[(i * 37 + n * 11) % (vocab - 3) + 3 for i in range(n)] for n in lengths]


def assert_a_sequences_bits_kept(path, num_tokens: int, **settings) -> None:
    """A sequence's tokens and logprobs are the same alone, decoding beside 4 others, and verifying its n-gram
    drafts (runs of up to num_tokens + 1 rows), in an engine made with `settings`."""
    from backend import LLM, SamplingParams

    plain = LLM(str(path), block_size=8, **settings)
    spec = LLM(str(path), block_size=8, **settings,
               speculative={"method": "ngram", "num_tokens": num_tokens, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [[5], [9, 14], [21, 3, 8], [40], [7, 7]]  # 9 prompt rows, then 5 decode rows a step
    together = [o.outputs[0] for o in plain.generate(prompts, params)]
    for prompt, out in zip(prompts, together):
        alone = plain.generate([prompt], params)[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    repeating = [prompts_of_lengths(30)[0] * 2]  # the n-gram lookup finds its drafts
    ours, theirs = spec.generate(repeating, greedy)[0].outputs[0], plain.generate(repeating, greedy)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids and ours.logprobs == theirs.logprobs  # the same bits
    stats = spec.engine.stats()  # some runs of 7 rows or more (6 drafts a run on average, or more)
    assert stats["spec_draft_tokens"] >= 6 * stats["spec_verifications"] > 0


@pytest.fixture(scope="session")
def smol_server(smollm2_path):
    """SmolLM2 behind the real server, shared by the tool-calling and Responses tests."""
    from tests.backend.server_process import ServerProcess

    proc = ServerProcess("smollm2", "--served-model-name", "smol", "--max-model-len", "1024", "--max-num-seqs", "8")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def qwen_server(tmp_path_factory):
    """A tiny random model with Qwen 2.5's chat template (which knows tools) behind the real server."""
    from tests.backend.server_process import ServerProcess
    from tests.backend.tiny_models import TOOLS_CHAT_TEMPLATE, build_model

    model = build_model("qwen2", tmp_path_factory.mktemp("tools") / "tiny-qwen", chat_template=TOOLS_CHAT_TEMPLATE,
                        max_position_embeddings=2048)  # its tokenizer spells JSON out nearly a character a token
    proc = ServerProcess(str(model), "--served-model-name", "tiny", "--max-model-len", "2048")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the module's own `server` fixture (a ServerProcess)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def smol(smol_server):
    """The official OpenAI client on smol_server (a test module may define its own `smol`)."""
    import openai

    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tiny(qwen_server):
    """The official OpenAI client on qwen_server."""
    import openai

    return openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key="unused", max_retries=0)


# Our C kernels' builds: for this CPU, and on an x86 CPU its other code paths too.
KERNEL_BUILDS = {"native": None, "avx2": "haswell", "portable": "x86-64"}
# and AVX2 with AVX-VNNI's 8-lane vpdpbusd, no AVX-512 (Intel's client cores since Alder Lake), where this CPU has
# AVX-VNNI: only the tests of the 8-bit kernel's bits take it
MARCHES = {**KERNEL_BUILDS, "avx_vnni": "alderlake"}


def use_kernel_build(build: str, monkeypatch) -> None:
    """Our C kernels as built for this CPU ("native"), or (on x86) as built for AVX2 alone (8-wide vectors, tiles
    of 4 rows, 3 for signed products) where this CPU has AVX-512 or AVX-VNNI, for AVX2 with AVX-VNNI ("avx_vnni")
    where this CPU has both it and AVX-512, or without AVX at all: GCC's portable vectors, the code ARM CPUs run."""
    from backend.kernels import native

    if native.library() is None:
        pytest.skip("no C compiler for the CPU kernels")
    march = MARCHES[build]
    if march is not None:
        if platform.machine() != "x86_64":
            pytest.skip("the native build is this CPU's only one")
        flags = native._cpu_key().split()
        if build == "avx_vnni" and "avx_vnni" not in flags:
            pytest.skip("this CPU has no AVX-VNNI")
        native_build = None if "avx512f" in flags else "avx_vnni" if "avx_vnni" in flags else "avx2"
        if build == native_build:
            pytest.skip(f"this CPU has no AVX-512: the native build is the {build} one")
        lib = native.load(native.build(march))
        monkeypatch.setattr(native, "library", lambda: lib)


def count_c_calls(monkeypatch, entry: str) -> list:
    """From here on, each call of our C library's `entry` (through native.library()) appends its second argument
    (the rows it is given) to the list returned, then runs as it would."""
    from backend.kernels import native

    lib, calls = native.library(), []

    def counted(*args):
        calls.append(args[1])
        return getattr(lib, entry)(*args)

    class Counting:
        def __getattr__(self, name):
            return counted if name == entry else getattr(lib, name)

    counting = Counting()
    monkeypatch.setattr(native, "library", lambda: counting)
    return calls


def fp32_order() -> str:
    """Where an fp32 engine's quantized weights lie in the kernel build in use: quads against x in three 8-bit
    digits with VNNI, the fp32 kernel's panels without (QuantWeight.pack_for_cpu)."""
    from backend.kernels import native

    return "digits" if native.vnni() else "panels"


@pytest.fixture(params=list(KERNEL_BUILDS))
def c_kernels(request, monkeypatch):
    use_kernel_build(request.param, monkeypatch)
    return request.param
