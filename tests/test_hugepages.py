"""`kvjax.hugepages`: when the command and the benchmarks re-execute themselves for huge pages, with what environment,
and that the re-executed process has them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvjax import hugepages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(str(f)) == "always"
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("value,want", [("", False), ("glibc.malloc.hugetlb=1", True),
                                        ("glibc.malloc.check=3:glibc.malloc.hugetlb=2", True),
                                        ("glibc.malloc.hugetlb=0", False), ("glibc.malloc.hugetlbx=1", False)])
def test_tunable_set_parses_glibc_tunables(value, want):
    assert hugepages.tunable_set({"GLIBC_TUNABLES": value}) is want


def test_reexec_env_only_where_it_changes_something(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages, "glibc_version", lambda: (2, 36))
    env = hugepages.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.check=3", "PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.check=3:glibc.malloc.hugetlb=1" and env["PATH"] == "/bin"
    assert hugepages.status(env)["active"] and hugepages.reexec_env(env) is None  # never a second time
    assert hugepages.reexec_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert hugepages.reexec_env({"KVJAX_HUGEPAGES": "0"}) is None  # turned off
    assert hugepages.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) is None  # already there
    monkeypatch.setattr(hugepages, "glibc_version", lambda: (2, 31))
    assert hugepages.reexec_env({}) is None and "glibc >= 2.35" in hugepages.status({})["reason"]
    monkeypatch.setattr(hugepages, "glibc_version", lambda: (2, 36))
    for mode in ("always", "never", None):
        monkeypatch.setattr(hugepages, "thp_mode", lambda mode=mode: mode)
        assert hugepages.reexec_env({}) is None
    assert not hugepages.status({})["active"] and "not available" in hugepages.status({})["reason"]


def test_a_process_that_reexecutes_gets_huge_pages_and_keeps_its_command_line(tmp_path):
    st = hugepages.status({})
    if st["thp_mode"] != "madvise" or (hugepages.glibc_version() or (0, 0)) < (2, 35):
        pytest.skip(f"huge pages come another way here or not at all: {st}")
    script = tmp_path / "child.py"
    script.write_text("import sys\nfrom kvjax import hugepages\nhugepages.reexec()\n"
                      "print(hugepages.status()['active'], sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "KVJAX_HUGEPAGES",
                                                            "KVJAX_HUGEPAGES_REEXEC")}
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, str(script), "a b", "c"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True ['a b', 'c']"
    env["KVJAX_HUGEPAGES"] = "0"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "False []"
