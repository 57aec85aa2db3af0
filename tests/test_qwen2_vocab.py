"""The Qwen2 vocabulary (152,064 tokens, pre-tokenizer 'deepseek-r1-qwen') of the real
DeepSeek-R1-Distill-Qwen-7B Q4_K_M file, from a metadata-only copy of its published first part
(tests/data/qwen2-vocab.gguf.xz, written by `tests/test_qwen2_vocab.py --write`): ember's ids against
llama-tokenize's on hard text, stored (tests/data/qwen2-vocab.tokenize.json) and, where llama.cpp
is installed, live."""
from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest

from conftest import DATA
from test_tokenizer import hard_text, llama_tokenize, needs_llama_cpp

from ember.gguf_loader import GGUFFile
from ember.tokenizer import Tokenizer

FIXTURE = DATA / "qwen2-vocab.gguf.xz"
IDS = DATA / "qwen2-vocab.tokenize.json"
SEED = 26


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2") / "qwen2-vocab.gguf"
    path.write_bytes(lzma.decompress(FIXTURE.read_bytes()))
    return path


@pytest.fixture(scope="module")
def tok(vocab_file) -> Tokenizer:
    with GGUFFile(vocab_file) as f:
        return Tokenizer.from_metadata(f.metadata)


def test_the_file_is_the_qwen2_vocabulary(vocab_file, tok):
    with GGUFFile(vocab_file) as f:
        md = f.metadata
    assert md["general.architecture"] == "qwen2" and md["tokenizer.ggml.pre"] == "deepseek-r1-qwen"
    assert tok.n_vocab == 152064 and tok.add_bos and tok.bos_id == 151646


@pytest.mark.parametrize("parse_special", [False, True])
def test_same_ids_as_llama_tokenize_stored(tok, parse_special):
    stored = json.loads(IDS.read_text())
    text = hard_text(tok, SEED)
    want = stored["parse_special" if parse_special else "plain"]
    got = tok.encode(text, add_special=False, parse_special=parse_special)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"first difference at token {first} of {len(want)}"


@needs_llama_cpp
@pytest.mark.parametrize("parse_special", [False, True])
def test_same_ids_as_llama_tokenize_live(tok, vocab_file, tmp_path, parse_special):
    text_file = tmp_path / "text.txt"
    text = hard_text(tok, SEED)
    text_file.write_bytes(text.encode("utf-8"))  # byte for byte: the text holds lone "\r"s
    assert tok.encode(text, add_special=False, parse_special=parse_special) \
        == llama_tokenize(vocab_file, text_file, parse_special)


def write(part: Path) -> None:
    """The fixture from the first part of the real file, and llama-tokenize's ids on it."""
    import gguf

    from families import add_metadata

    with GGUFFile(part, partial=True) as f:
        md = dict(f.metadata)
    out = Path("/tmp") / "qwen2-vocab.gguf"
    w = gguf.GGUFWriter(str(out), md.pop("general.architecture"))
    for key, value in md.items():
        if key not in ("general.quantization_version", "general.file_type", "tokenizer.chat_template"):
            add_metadata(w, key, value)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    FIXTURE.write_bytes(lzma.compress(out.read_bytes(), preset=9))
    with GGUFFile(out) as f:
        text = hard_text(Tokenizer.from_metadata(f.metadata), SEED)
    text_file = Path("/tmp") / "qwen2-vocab.txt"
    text_file.write_text(text, encoding="utf-8")
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import peer  # LLAMA_CPP_DIR names llama.cpp's place where it is not beside the checkout

    def ids(parse_special: bool) -> list[int]:
        args = ["-m", str(out), "-f", str(text_file), "--ids", "--no-bos", "--no-escape", "--log-disable"]
        proc, _ = peer.run("llama-tokenize", args + ([] if parse_special else ["--no-parse-special"]))
        return json.loads(proc.stdout.strip().splitlines()[-1])

    IDS.write_text(json.dumps({"source": "llama-tokenize (llama-cpp-python 0.3.36's llama.cpp), --no-bos --ids",
                               "plain": ids(False), "parse_special": ids(True)}))


if __name__ == "__main__":  # python tests/test_qwen2_vocab.py --write PART_FILE
    sys.path.insert(0, str(Path(__file__).parent))
    write(Path(sys.argv[2]))
