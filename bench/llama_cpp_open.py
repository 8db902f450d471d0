"""llama-cpp-python's Llama for the bench/llama_cpp_*.py peer scripts (run in the peer's own venv).

LLAMA_CPP_EXTRA_BUFTS=0 loads the weights without llama.cpp's extra buffer types (its AMX and repacked layouts),
as llama.cpp's --no-extra-bufts does: on an AMX CPU (an Intel Xeon VM, 2026-12-07) llama-cpp-python 0.3.36 crashes
with SIGSEGV in ggml_backend_amx_mul_mat on the first evaluation of every file tried (llama.cpp issue 20824, closed
without a fix), and bench/run_peer.py then reruns the job this way. llama-cpp-python has no argument for it, so the
default model parameters it starts from are wrapped.
"""

import os


def llama(**kwargs):
    """Llama(**kwargs), without the extra buffer types where LLAMA_CPP_EXTRA_BUFTS=0."""
    import llama_cpp
    import llama_cpp.llama as module

    if os.environ.get("LLAMA_CPP_EXTRA_BUFTS") == "0":
        defaults = llama_cpp.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        module.llama_cpp.llama_model_default_params = without_extra_buffers
    return module.Llama(**kwargs)
