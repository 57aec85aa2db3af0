"""What a model file must promise before ember computes with it: edited copies of the real files
(hyper-parameters out of range or at odds with the tensors, tensors of the wrong size or type, a
damaged vocabulary) are refused at load with one ModelError/TokenizerError line naming the key or
tensor, what was expected and what was found; the CLI and the server show that line."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from gguf_edit import EditableCopy, rewrite
from test_server_harness import LiveServer
from ember import hub
from ember.app import ModelConfig, ServerConfig, create_app, load_model
from ember.engine import LLM
from ember.gguf_loader import GGUFFile
from ember.models import ModelError
from ember.sampler import SamplingParams
from ember.tokenizer import TokenizerError

GREEDY = SamplingParams.greedy_params()
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    copy = EditableCopy(hub.resolve("smollm2"), tmp_path_factory.mktemp("edits") / "smollm2.gguf")
    yield copy
    copy.path.unlink()  # 100-250 MB: not for pytest's kept temp dirs


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    copy = EditableCopy(hub.resolve("gemma3-270m"), tmp_path_factory.mktemp("edits") / "gemma3.gguf")
    yield copy
    copy.path.unlink()


def load(path) -> LLM:
    return LLM(str(path), device="cpu", threads=2, ctx=64, slots=1)


def refused(path, error=ModelError) -> str:
    """The one-line error loading `path` gives."""
    with pytest.raises(error) as info:
        load(path).close()
    message = str(info.value)
    assert "\n" not in message and message
    return message


def token_offset(path, index: int) -> int:
    """Where the text of tokenizer.ggml.tokens[index] starts in the file."""
    import struct

    with GGUFFile(path) as f:
        size = f.data_offset
    with open(path, "rb") as fh:
        head = fh.read(size)
    key = b"tokenizer.ggml.tokens"
    pos = head.index(key) + len(key) + 4 + 4 + 8  # value type, element type, count
    for _ in range(index):
        pos += 8 + struct.unpack_from("<Q", head, pos)[0]
    return pos + 8


# ---- the cases the hostile files found ----

@pytest.mark.parametrize("value, type_name, expected", [
    (0, "u32", "metadata 'llama.block_count' is 0; expected an integer from 1 to"),
    (-3, "i32", "metadata 'llama.block_count' is -3; expected an integer from 1 to"),
    (29, "u32", "metadata 'llama.block_count' is 29; expected the number of layers the file has tensors for "
                "(30: blk.0 .. blk.29)"),
    (31, "u32", "(30: blk.0 .. blk.29)"),
])
def test_block_count_must_match_the_layers(smollm, value, type_name, expected):
    """0 once generated " is is is" from the embeddings alone; 29 would drop a layer silently."""
    with smollm.edit() as e:
        e.set("llama.block_count", value, type_name)
        assert expected in refused(smollm.path)


@pytest.mark.parametrize("value, expected", [
    (0, "metadata 'llama.rope.dimension_count' is 0; expected an integer from 2 to 64"),
    (65, "metadata 'llama.rope.dimension_count' is 65; expected an integer from 2 to 64"),
    (63, "metadata 'llama.rope.dimension_count' is 63; expected an even number from 2 to the head size 64"),
])
def test_rope_dimensions_must_fit_the_head(smollm, value, expected):
    """Outside 2..head size the rotary kernel skipped its work and the model ran unrotated."""
    with smollm.edit() as e:
        e.set("llama.rope.dimension_count", value)
        assert refused(smollm.path) == expected


def test_rotary_factors_are_checked_and_used(smollm, tmp_path):
    """rope_freqs.weight holds one factor per rotated pair (32 here): 31 are refused (the kernel read
    past them), an F16 vector too (read as floats); 32 ones load and give the file's own tokens."""
    want = load(smollm.path)
    try:
        reference = want.generate(want.tokenize(PROMPT), 6, GREEDY).token_ids
    finally:
        want.close()
    for factors, expected in ((np.ones(31, np.float32), "tensor 'rope_freqs.weight' has shape (31,), expected (32,)"),
                              (np.ones(32, np.float16), "tensor 'rope_freqs.weight' has type F16, expected F32")):
        path = rewrite(smollm.path, tmp_path / "factors.gguf", tensors={"rope_freqs.weight": factors})
        assert refused(path) == expected
    path = rewrite(smollm.path, tmp_path / "ones.gguf", tensors={"rope_freqs.weight": np.ones(32, np.float32)})
    m = load(path)
    try:
        assert m.generate(m.tokenize(PROMPT), 6, GREEDY).token_ids == reference
    finally:
        m.close()
    for written in tmp_path.glob("*.gguf"):
        written.unlink()


def test_vocabulary_and_embeddings_must_agree(smollm, tmp_path):
    """The token list, llama.vocab_size and the embedding and output rows: once they disagreed,
    the failure came only while generating."""
    with smollm.edit() as e:
        e.set_dims("token_embd.weight", (576, 49151))
        assert refused(smollm.path) == "tensor 'token_embd.weight' has shape (49151, 576), expected (49152, 576)"
    with smollm.edit() as e:
        e.set("llama.vocab_size", 49153)
        assert refused(smollm.path) == ("metadata 'llama.vocab_size' is 49153; expected the number of tokens of "
                                        "tokenizer.ggml.tokens (49152)")
    with GGUFFile(smollm.path) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
        types = np.array(f.metadata["tokenizer.ggml.token_type"])
    path = rewrite(smollm.path, tmp_path / "short.gguf", drop=("llama.vocab_size",), metadata={
        "tokenizer.ggml.tokens": (tokens[:-1], "array[string]"), "tokenizer.ggml.token_type": (types[:-1], "array[i32]")})
    assert refused(path) == "tensor 'token_embd.weight' has shape (49152, 576), expected (49151, 576)"
    path.unlink()


def test_norm_weights_must_be_float32_vectors(smollm):
    """A norm vector of another type was read as floats past its end."""
    with smollm.edit() as e:
        e.set_raw(smollm.records["output_norm.weight"].type_at, (1).to_bytes(4, "little"))  # F16
        assert refused(smollm.path) == "tensor 'output_norm.weight' has type F16, expected F32"


def test_a_damaged_token_is_one_line(smollm):
    """One flipped byte leaving a byte-level token as invalid UTF-8 gave a 29-line TypeError."""
    with smollm.edit() as e:
        e.set_raw(token_offset(smollm.path, 300), b"\xff")
        assert refused(smollm.path, TokenizerError) == \
            "tokenizer.ggml.tokens[300] is not valid UTF-8 (b'\\xffm'): the file is damaged"


@pytest.mark.parametrize("key, value, type_name, expected", [
    ("gemma3.attention.sliding_window", 0, "u32", "metadata 'gemma3.attention.sliding_window' is 0; expected an "
                                                   "integer from 1 to"),
    ("gemma3.attention.value_length", 128, "u32", "metadata 'gemma3.attention.value_length' is 128; expected "
                                                   "attention.key_length (256)"),
    ("gemma3.attention.head_count_kv", 3, "u32", "metadata 'gemma3.attention.head_count_kv' is 3; expected a "
                                                  "divisor of attention.head_count (4)"),
    ("gemma3.rope.freq_base", math.nan, "f32", "metadata 'gemma3.rope.freq_base' is nan; expected a finite number "
                                                "above 0 and at most 1e+12"),
    ("gemma3.attention.layer_norm_rms_epsilon", -1e-6, "f32", "metadata 'gemma3.attention.layer_norm_rms_epsilon' "
                                                               "is -9.999999974752427e-07; expected a finite number"),
])
def test_gemma_hyperparameters(gemma, key, value, type_name, expected):
    with gemma.edit() as e:
        e.set(key, value, type_name)
        assert refused(gemma.path).startswith(expected)


def test_the_cli_and_the_server_show_the_one_line(smollm):
    with smollm.edit() as e:
        e.set("llama.block_count", 0)
        run = subprocess.run([sys.executable, "-m", "ember.cli", "run", str(smollm.path), "-p", "Hi", "-n", "2"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "Traceback" not in run.stderr
        assert run.stderr.strip().splitlines() == [
            "ember: error: metadata 'llama.block_count' is 0; expected an integer from 1 to 134217728"]
        config = ModelConfig(str(smollm.path), device="cpu", threads=2, ctx=64, slots=1)
        with LiveServer(create_app(ServerConfig(), lambda: load_model(config))) as live:
            health = httpx.get(live.url + "/health")
            while health.json()["error"]["message"] == "Loading model":
                health = httpx.get(live.url + "/health")
            assert health.status_code == 503
            assert health.json()["error"]["message"] == ("Model failed to load: ModelError: metadata "
                                                         "'llama.block_count' is 0; expected an integer from 1 to 134217728")


# ---- every numeric hyper-parameter: refused in one line, or harmless ----

SWEEP = {  # type -> (value, type written): 0, negative, huge (and not a number, or not an integer)
    "u32": [(0, "u32"), (-1, "i32"), (2**31 - 1, "u32"), (2**32 - 1, "u32"), (1.5, "f32"), (math.inf, "f32")],
    "i32": [(0, "i32"), (-1, "i32"), (2**31 - 1, "i32")],
    "u64": [(0, "u64"), (-1, "i64"), (2**63 - 1, "u64")],
    "f32": [(0.0, "f32"), (-1.0, "f32"), (1e30, "f32"), (math.nan, "f32"), (math.inf, "f32")],
}


def numeric_keys(copy: EditableCopy) -> list[str]:
    return [k for k, t in copy.types.items() if t in SWEEP and not k.startswith("tokenizer.")]


def token_id_keys(copy: EditableCopy) -> list[str]:
    return [k for k, t in copy.types.items() if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]


def sweep_cases(copy: EditableCopy):
    """(key, value, type written) of the sweep: every value for the model's numbers; negative and
    huge for the tokenizer's special ids (0 is a real token: another id, not a broken one)."""
    for key in numeric_keys(copy):
        for value, type_name in SWEEP[copy.types[key]]:
            yield key, value, type_name
    for key in token_id_keys(copy):
        yield from ((key, -1, "i32"), (key, 2**31 - 1, copy.types[key]))


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_every_numeric_hyperparameter_is_refused_or_harmless(name, request):
    """Each numeric metadata value set to 0, a negative, a huge value, NaN and infinity (the
    tokenizer's special ids to a negative and a huge one): loading fails with one ModelError or
    TokenizerError line, or succeeds and the model gives the file's own greedy tokens. Never
    another exception, never other tokens."""
    copy = request.getfixturevalue(name)
    m = load(copy.path)
    try:
        reference = m.generate(m.tokenize(PROMPT), 3, GREEDY).token_ids
    finally:
        m.close()
    outcomes = {}
    for key, value, type_name in sweep_cases(copy):
        with copy.edit() as e:
            e.set(key, value, type_name)
            try:
                m = load(copy.path)
            except (ModelError, TokenizerError) as err:
                assert "\n" not in str(err)
                outcomes[key, value] = "refused"
                continue
            try:
                assert m.generate(m.tokenize(PROMPT), 3, GREEDY).token_ids == reference, (key, value)
            finally:
                m.close()
            outcomes[key, value] = "harmless"
    arch = "llama" if name == "smollm" else "gemma3"
    harmless = {k for (k, _), o in outcomes.items() if o == "harmless"}
    assert harmless <= {"general.file_type", "general.quantization_version", "tokenizer.ggml.padding_token_id",
                        "tokenizer.ggml.unknown_token_id"}
    assert all(outcomes[f"tokenizer.ggml.{role}_token_id", v] == "refused" for role in ("bos", "eos")
               for v in (-1, 2**31 - 1))
    assert all(outcomes[f"{arch}.block_count", v] == "refused" for v in (0, -1, 2**31 - 1, 1.5, math.inf))
    assert len(outcomes) >= (60 if arch == "llama" else 70)
