"""Text <-> token ids, and chat messages -> token ids, matching Hugging Face `transformers` exactly.

The token ids a request becomes are part of a cache entry's identity (DESIGN.md, idea 3), so this module must give
the ids `transformers.AutoTokenizer` gives for the same model directory. It reads the same files:
`tokenizer.json` through the `tokenizers` library (the same Rust code transformers' fast tokenizers run), and the
chat template from `chat_template.jinja` or `tokenizer_config.json`, rendered with jinja2 configured the way
transformers configures it (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
`strftime_now`, a non-escaping `tojson`). The rendered string is encoded without adding special tokens, as
transformers does, because templates write their own control tokens.

Limits: no `tools`/`documents` schema conversion from Python callables (pass JSON-schema dicts), no
`continue_final_message`, no assistant-token masks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Sequence

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or a dict with 'content', got {value!r}")


def _read_chat_template(path: str, config: dict) -> str | None:
    # transformers >= 4.43 saves the template as its own file and prefers it over tokenizer_config.json.
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # the older named-templates form: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(f"{path}: chat_template has no 'default' entry (names: {sorted(named)})")
        template = named["default"]
    return template


def _compile_template(source: str):
    """Compile a chat template in a jinja environment configured like transformers' (see module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the rendered prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A model directory's tokenizer: `tokenizers.Tokenizer` + special tokens + chat template.

    `from_dir` reads a Hugging Face directory; a GGUF file's tokenizer is built from its metadata by
    `kvjax.formats.gguf_tokenizer.gguf_tokenizer` through the constructor (backend, special tokens, template).

    Attributes:
      backend: the `tokenizers.Tokenizer` loaded from tokenizer.json.
      chat_template: jinja source, or None when the directory has none.
      bos_token, eos_token, unk_token, pad_token: special token strings (None when unset).
    """

    def __init__(self, backend, config: dict | None = None, chat_template: str | None = None,
                 raw_json: bytes | None = None, path: str | None = None):
        config = config or {}
        self.backend = backend
        self.path = path
        self.chat_template = chat_template
        self.config = config
        for key in _SPECIAL_KEYS:
            setattr(self, key, _token_content(config.get(key)))
        self._raw_json = raw_json if raw_json is not None else backend.to_str().encode("utf-8")
        self._compiled = None

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Load tokenizer.json (required) and tokenizer_config.json / chat_template.jinja (optional) from `path`."""
        from tokenizers import Tokenizer as _Backend

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"tokenizer.json not found: {tj} (kvjax needs a fast-tokenizer tokenizer.json)")
        with open(tj, "rb") as f:
            raw = f.read()
        backend = _Backend.from_str(raw.decode("utf-8"))
        config = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(backend, config, _read_chat_template(path, config), raw, path)

    # -- plain text -------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (accepts lists or integer numpy arrays)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what an embedding table must cover at least)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    # -- chat -------------------------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, **extra) -> str:
        """The chat template applied to `messages`, as text. `extra` keys are template variables."""
        if self.chat_template is None:
            where = self.path or "this tokenizer"
            raise ValueError(f"{where} has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        # Like transformers: the special tokens that are set (unset ones stay undefined, not "None"), then extras.
        variables = {k: getattr(self, k) for k in _SPECIAL_KEYS if getattr(self, k) is not None}
        variables.update(extra)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return self._compiled.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt, **variables)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **extra) -> list[int] | str:
        """Render `messages` with the chat template; return the text, or (tokenize=True) its ids.

        The rendered text is encoded with add_special_tokens=False, as transformers does: the template already
        wrote any BOS/control tokens it wants.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- identity ---------------------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 hex over tokenizer.json bytes, the chat template and the special tokens the template sees.

        Equal fingerprints give equal ids for equal text and equal chat messages.
        """
        h = hashlib.sha256()
        h.update(b"kvjax-tokenizer-v1\0")
        h.update(hashlib.sha256(self._raw_json).digest())
        h.update(hashlib.sha256((self.chat_template or "").encode("utf-8")).digest())
        h.update(json.dumps([getattr(self, k) for k in _SPECIAL_KEYS]).encode("utf-8"))
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"
