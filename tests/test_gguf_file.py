"""Our minimal GGUF reader against the gguf package's GGUFReader on the real file."""

import numpy as np
import pytest

import kvcourse
from kvcourse.gguf_file import read_gguf


@pytest.fixture(scope="module")
def both():
    import gguf

    path = kvcourse.gguf_path()
    return read_gguf(path), gguf.GGUFReader(str(path))


def test_metadata_equals_gguf_reader(both):
    (meta, _), reader = both
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert meta[key] == pytest.approx(value), key
        else:
            assert meta[key] == value, key
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(meta["tokenizer.ggml.merges"]) == 48900


def test_tensors_equal_gguf_reader(both):
    (_, tensors), reader = both
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert list(ours.shape) == [int(n) for n in theirs.shape], ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)
