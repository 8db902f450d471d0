"""Our GGUF reader against gguf-py's: every field's value and every tensor's type, shape and bytes."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from backend.gguf_file import GGUFFile


def assert_same_as_gguf_py(path):
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_smollm2_reads_as_gguf_py_reads_it(smollm2_path):
    assert_same_as_gguf_py(smollm2_path)


def test_every_value_and_tensor_type(tmp_path):
    from gguf.quants import quantize

    path = tmp_path / "all.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7), w.add_int8("t.i8", -7), w.add_uint16("t.u16", 65535), w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 2**32 - 1), w.add_int32("t.i32", -(2**31)), w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63)), w.add_float32("t.f32", 0.1), w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True), w.add_string("t.str", "ünï 漢字"), w.add_string("t.empty", "")
    w.add_array("t.ints", [1, 2, 3]), w.add_array("t.floats", [0.5, -1.5]), w.add_array("t.strs", ["a", "", "ç"])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((64,)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in (T.Q8_0, T.Q4_0, T.Q5_1):
        floats = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(kind.name.lower(), quantize(floats, kind), raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_same_as_gguf_py(path)


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_a_damaged_file_is_a_value_error(tmp_path, smollm2_path, damage):
    data = smollm2_path.read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + data[4:] if damage == "magic" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="GGUF magic" if damage == "magic" else "past the end"):
        GGUFFile(path)
