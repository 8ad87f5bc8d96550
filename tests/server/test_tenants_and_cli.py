"""Bearer tokens map to tenants: a tenant's prompts hit its own prefix-cache entries and never another tenant's (a
prompt another tenant cached looks uncached); unknown tokens are a 401. `kvjax serve` without its extra, or with a
malformed flag, fails in one line."""

from __future__ import annotations

import sys

import httpx
import pytest

from kvjax.cli.main import main as cli_main


@pytest.mark.slow  # a server of its own (~15 s warm, ~50 s cold); tests/prefix/test_tenant_isolation.py is the fast check
def test_tenants_share_nothing(start_server, tiny):
    url, engine, _ = start_server("vericache", api_keys={"key-a": "tenant-a", "key-b": "tenant-b"})
    prompt = list(range(100, 148))  # 48 tokens: three 16-token blocks

    def ask(key):
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"} if key else {},
                       json=dict(prompt=prompt, max_tokens=6, temperature=0), timeout=120)
        return r.status_code, r.json()

    assert ask(None)[0] == 401 and ask("key-c")[1]["error"]["code"] == "invalid_api_key"
    pc = engine.prefix_cache
    a1 = ask("key-a")
    a2 = ask("key-a")
    b1 = ask("key-b")
    assert a1[0] == a2[0] == b1[0] == 200
    ids = [r[1]["choices"][0]["token_ids"] for r in (a1, a2, b1)]
    assert ids[0] == ids[1] == ids[2]  # the same tokens with or without a hit
    st_a, st_b = pc.stats(tenant="tenant-a"), pc.stats(tenant="tenant-b")
    assert st_a["hit_tokens"] > 0  # tenant a's second request reused its first one's prefix
    assert st_b["hit_tokens"] == 0  # tenant b saw nothing of a's entries...
    assert st_b["misses"]["compatibility"] == {"not cached": len(prompt)}  # ...not even that they exist
    assert "entries" not in st_b


def test_missing_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    assert cli_main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'serve' extra" in err[0] and "uvicorn" in err[0]


def test_bad_flags(capsys):
    assert cli_main(["serve", "--api-key", "nokey"]) == 2
    assert "--api-key takes KEY=TENANT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--mode", "fast"])
    assert "--mode" in capsys.readouterr().err
