"""The CPU kernels compile in the background while a first start reads the model (native.build_in_background):
a caller that needs them meanwhile waits for that compile and maps its library; the compiler runs once."""

import subprocess

import pytest

from backend.kernels import native


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_the_background_compile_is_the_only_one(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    compiles = []
    run = subprocess.run

    def counting(args, **kwargs):
        compiles.append(args[0])
        return run(args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting)
    native.library.cache_clear()
    try:
        native.build_in_background()
        lib = native.library()  # while the thread compiles: waits for it
        assert lib is not None and lib.qmm is not None
        assert len(compiles) == 1 and list((tmp_path / "native").glob("cpu_kernels-*.so"))
        native.build_in_background()  # built: nothing more starts
        assert len(compiles) == 1
    finally:
        native.library.cache_clear()
