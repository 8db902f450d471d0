import pytest

from tests.backend.server_process import ServerProcess


@pytest.fixture(scope="session")
def poison_server(tiny_dir):
    """The real backend on a tiny random model, shared by the fault and load tests of the backend."""
    # max_tokens past the context refused, as vLLM does (clamping is the default): its poison cases stay poison
    proc = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--max-num-seqs", "32",
                         "--block-size", "8", "--max-model-len", "256", "--max-tokens-past-context", "refuse")
    yield proc
    assert proc.stop() == 0
