"""kvjax.tokenizer: exact round-trip, and token ids equal to transformers' for text and chat templates."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import pytest

from kvjax.data import corpus
from kvjax.tokenizer import Tokenizer
from builders import CHECKPOINTS

SHIPPED = os.path.join(CHECKPOINTS, "kvjax-code-tiny")

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tdef __init__(self):\r\n\t\tself.x = 12345  # comment\n\n\n",
    "naïve café — ∑ λx. 你好 🙂 \u00a0nbsp \ufffd replacement",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",  # special tokens inside plain text
    "",
    "x" * 300 + "\n" * 7 + "0123456789" * 5,
]

CHATS = [
    [{"role": "user", "content": "Write a function."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def f():\n    pass"},
     {"role": "assistant", "content": "ok  "}, {"role": "user", "content": "ünïcödé 🙂 <|im_end|>"}],
]

# A Llama-3-style template written for this test: BOS from the variable, header tokens, `trim`, a loop break,
# `tojson` of non-ASCII tools, an extra template variable and `strftime_now`.
LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + tools | tojson + '<|eot_id|>' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message['role'] == 'stop' %}{% break %}{% endif %}\n"
    "  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}\n"
    "  {{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- '' if not date_string else 'date: ' + date_string }}"
    "{{- '' if strftime_now('%Y') | length == 4 else 'bad year' }}"
)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# A template that rejects conversations not starting with a user turn, through `raise_exception`. Written across
# indented lines without `-` whitespace control, so the output also depends on trim_blocks and lstrip_blocks.
STRICT = """{% if messages[0]['role'] != 'user' %}
    {{ raise_exception('Conversation must start with a user message') }}
{% endif %}
{% for m in messages %}
    {% if loop.index0 % 2 == 0 and m['role'] != 'user' %}
        {{ raise_exception('roles must alternate user/assistant') }}
    {% endif %}
{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
{% endif %}
"""


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SHIPPED)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


def _hf_chat_ids(hf_tok, messages, **kw):
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def _variant_dir(tmp_path, template, extra_config, add_tokens=()):
    """A tokenizer dir with the shipped vocabulary (plus `add_tokens` as special tokens) and another config."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    if add_tokens:
        backend.add_special_tokens(list(add_tokens))
        backend.save(str(tmp_path / "tokenizer.json"))
    else:
        shutil.copy(os.path.join(SHIPPED, "tokenizer.json"), tmp_path / "tokenizer.json")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=template, **extra_config)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_shipped_tokenizer_basics(tok):
    assert tok.vocab_size == 4096
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.bos_token is None and tok.bos_token_id is None


def test_round_trip_real_code(tok):
    files = corpus.split_files("val")[:8]
    text = "".join(corpus.read_file(f) for f in files)
    assert len(text) > 20_000
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.5  # the BPE merges do compress code (bytes alone would be ~1.0)
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t


def test_encode_matches_transformers(tok, hf):
    code = corpus.read_file(corpus.split_files("heldout")[0])
    for t in TEXTS + [code]:
        assert tok.encode(t) == hf.encode(t, add_special_tokens=False), t[:40]
        assert tok.encode(t, add_special_tokens=True) == hf.encode(t), t[:40]
    assert tok.encode("<|im_end|>") == [2]  # special tokens in text are matched, as in transformers


def test_chatml_template_matches_transformers(tok, hf):
    for messages in CHATS:
        for gen in (False, True):
            ids = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ids == _hf_chat_ids(hf, messages, add_generation_prompt=gen)
            text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(CHATS[0])[0] == 1


def test_llama3_style_template_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = _variant_dir(tmp_path, LLAMA3_STYLE, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                        add_tokens=LLAMA3_TOKENS)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    tools = [{"name": "größe", "description": "naïve <tag> & ü"}]
    stopped = CHATS[1][:2] + [{"role": "stop", "content": "x"}] + CHATS[1][2:]
    cases = [dict(messages=CHATS[0]), dict(messages=CHATS[1], add_generation_prompt=True),
             dict(messages=CHATS[1], tools=tools, date_string="26 Jul 2024"), dict(messages=stopped)]
    for kw in cases:
        ids = ours.apply_chat_template(**kw)
        assert ids == _hf_chat_ids(theirs, **kw)
        assert ids[0] == ours.token_to_id("<|begin_of_text|>") == ours.bos_token_id
    text = ours.apply_chat_template(**cases[2], tokenize=False)
    assert '"größe"' in text and "<tag> & ü" in text and text.endswith("date: 26 Jul 2024")
    assert "ok<|eot_id|>" in text  # `trim` applied
    assert "ok" not in ours.apply_chat_template(**cases[3], tokenize=False)  # `{% break %}` stopped the loop


def test_raise_exception_template_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = _variant_dir(tmp_path, STRICT, dict(eos_token="<|im_end|>"))
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ours.apply_chat_template(good, add_generation_prompt=True) == _hf_chat_ids(
        theirs, good, add_generation_prompt=True)
    text = ours.apply_chat_template(good, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n    <|im_start|>assistant\n\n"
    for bad, msg in [(CHATS[1], "must start with a user"), (good + good[1:], "alternate")]:
        with pytest.raises(jinja2.exceptions.TemplateError, match=msg):
            ours.apply_chat_template(bad)
        with pytest.raises(jinja2.exceptions.TemplateError, match=msg):
            theirs.apply_chat_template(bad)


def test_loud_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(str(tmp_path))
    shutil.copy(os.path.join(SHIPPED, "tokenizer.json"), tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(str(tmp_path))  # no tokenizer_config.json: text works, chat does not
    assert bare.decode(bare.encode("a b")) == "a b"
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template(CHATS[0])


def test_fingerprint(tmp_path, tok):
    again = Tokenizer.from_dir(SHIPPED)
    assert again.fingerprint() == tok.fingerprint() and len(tok.fingerprint()) == 64
    other = Tokenizer.from_dir(_variant_dir(tmp_path, STRICT, dict(eos_token="<|endoftext|>")))
    assert other.fingerprint() != tok.fingerprint()  # same tokenizer.json, different template
