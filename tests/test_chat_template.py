"""Chat templates: the file's template (SmolLM2) against llama-server's rendered prompts, the
built-in Gemma and ChatML templates, BOS handling, and template errors."""
from __future__ import annotations

import json

import pytest

from conftest import DATA, golden
from ember.gguf_loader import GGUFFile
from ember.tokenizer import Tokenizer
from ember.tokenizer.chat import ChatTemplate, ChatTemplateError, builtin_source

PROMPTS = {p["name"]: p for p in json.loads((DATA / "corpus.json").read_text())["prompts"]}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3? "},
                                 {"type": "image_url", "image_url": {}}]},
]


@pytest.fixture(scope="module")
def model(model_path):
    cache = {}

    def get(name):
        if name not in cache:
            with GGUFFile(model_path(name)) as f:
                md = f.metadata
            cache[name] = md, Tokenizer.from_metadata(md), ChatTemplate.from_metadata(md)
        return cache[name]
    return get


def chat_cases(name):
    return [c for c in golden(name, "greedy")["cases"] if c["chat"]]


def test_smollm2_file_template_matches_llama_server(model):
    _, tok, tmpl = model("smollm2")
    assert tmpl.source == "file"
    for case in chat_cases("smollm2"):
        text = tmpl.render([{"role": "user", "content": PROMPTS[case["name"]]["prompt"]}])
        assert text == case["prompt_text"], case["name"]
        assert tmpl.encode(tok, text) == case["prompt_ids"], case["name"]


def test_gemma_builtin_template(model):
    _, tok, tmpl = model("gemma3-270m")
    assert tmpl.source == "builtin:gemma"
    text = tmpl.render(CONVERSATION)
    assert text == ("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n"
                    "<start_of_turn>model\n4<end_of_turn>\n"
                    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert tmpl.render(CONVERSATION[1:3], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n")
    # one BOS: the template's text is cut, the tokenizer adds the token; turn markers are parsed
    ids = tmpl.encode(tok, tmpl.render([{"role": "user", "content": "Hi"}]))
    assert ids == [2, 105, *tok.encode("user\nHi", add_special=False), 106, 107, 105,
                   *tok.encode("model\n", add_special=False)]
    assert ids.count(tok.bos_id) == 1


def test_chatml_builtin_matches_llama_server_fallback(model):
    """llama-server rendered Gemma's chat prompts with its ChatML fallback; ours writes the same."""
    md, tok, _ = model("gemma3-270m")
    md = {k: v for k, v in md.items() if k != "general.architecture"}
    tmpl = ChatTemplate.from_metadata(md)
    assert tmpl.source == "builtin:chatml"
    for case in chat_cases("gemma3-270m"):
        text = tmpl.render([{"role": "user", "content": PROMPTS[case["name"]]["prompt"]}])
        assert text == case["prompt_text"], case["name"]
        assert tmpl.encode(tok, text) == case["prompt_ids"], case["name"]


def test_builtin_templates_are_package_data():
    assert "<start_of_turn>" in builtin_source("gemma")
    assert "<|im_start|>" in builtin_source("chatml")


def test_strip_bos_eos():
    t = ChatTemplate.from_string("{{ bos_token }}x{{ eos_token }}", bos_token="<s>", eos_token="</s>",
                                 add_bos=True, add_eos=True)
    assert t.render([]) == "<s>x</s>"
    assert t.strip_bos_eos(t.render([])) == "x"
    t = ChatTemplate.from_string("{{ bos_token }}x", bos_token="<s>", add_bos=False)
    assert t.strip_bos_eos(t.render([])) == "<s>x"  # the tokenizer adds no BOS: keep the text


def test_template_variables_and_helpers():
    t = ChatTemplate.from_string(
        "{{ messages[0].content | tojson }}|{{ tools | tojson(indent=1) }}|{{ add_generation_prompt }}"
        "|{{ flavour }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}")
    out = t.render([{"role": "user", "content": "héllo \"q\" <b>"}], tools=[{"name": "f"}], flavour="x")
    assert out == '"héllo \\"q\\" <b>"|[\n {\n  "name": "f"\n }\n]|True|x|4'


def test_trim_and_lstrip_blocks():
    t = ChatTemplate.from_string("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"


def test_raise_exception_is_a_chat_template_error():
    t = ChatTemplate.from_string(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render([{"role": "system", "content": ""}])


def test_syntax_error_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*line 1"):
        ChatTemplate.from_string("{% for m in messages %}{{ m.content }")


def test_runtime_error_is_a_chat_template_error():
    t = ChatTemplate.from_string("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed: TypeError"):
        t.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    t = ChatTemplate.from_string("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError"):
        t.render([])
    t = ChatTemplate.from_string("{% set x = messages.append(1) %}")
    with pytest.raises(ChatTemplateError):
        t.render([])
