"""kvjax.data.exact_tasks: the exact-answer task set is deterministic, every prompt has the stated length, the
needle sits where the task says, and only the needle supplies the answer."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvjax.data import exact_tasks
from kvjax.tokenizer import Tokenizer
from builders import CHECKPOINTS

pytest.importorskip("transformers")  # the haystack's distribution (the test extra)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(os.path.join(CHECKPOINTS, "kvjax-code-tiny"))


@pytest.fixture(scope="module")
def tasks(tok):
    return exact_tasks.make_tasks(tok, 1500, 6, seed=3)


def test_tasks_are_deterministic(tok, tasks):
    again = exact_tasks.make_tasks(tok, 1500, 6, seed=3)
    for a, b in zip(tasks, again):
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
        assert (a.answer, a.needle_token, a.haystack) == (b.answer, b.needle_token, b.haystack)
    other = exact_tasks.make_tasks(tok, 1500, 1, seed=4)[0]
    assert other.answer != tasks[0].answer


def test_needle_at_the_stated_depth_and_answer_only_there(tok, tasks):
    assert [t.kind for t in tasks] == ["value", "signature"] * 3
    assert [t.target_depth for t in tasks] == [0.1, 0.1, 0.3, 0.3, 0.5, 0.5]
    for t in tasks:
        assert t.prompt_ids.shape == (1500,) and t.prompt_ids.dtype == np.int32
        assert t.depth == round(t.needle_token / 1500, 3)
        assert abs(t.depth - t.target_depth) <= 0.1, (t.kind, t.target_depth, t.depth)
        before = tok.decode(t.prompt_ids[:t.needle_token])
        after = tok.decode(t.prompt_ids[t.needle_token:])
        key = t.answer.split('"')[0].split(",")[0]  # the value, or the first parameter's name
        assert key not in before  # nothing ahead of the needle gives the answer away
        assert after.lstrip().startswith(t.needle.strip()[:20])  # the needle starts at needle_token
        assert after.count(t.needle.strip()) == 1 and t.answer in t.needle  # the needle holds the answer, once
        assert not t.is_correct(after[-40:])  # the prompt does not end in the answer itself


def test_answers_are_checked_exactly(tasks):
    t = tasks[0]
    assert t.is_correct(t.answer + "\n    x = 1")
    assert not t.is_correct(" " + t.answer)
    assert not t.is_correct(t.answer[:-2] + "0" + t.answer[-1:])
    sig = tasks[1]
    assert sig.kind == "signature" and sig.is_correct("\n        " + sig.answer.replace(", ", ",\n        "))
    assert not sig.is_correct(sig.answer.replace("=None", "=0"))


def test_bad_arguments_name_the_problem(tok):
    with pytest.raises(ValueError, match="depth"):
        exact_tasks.make_task(tok, 1000, "value", 1.0, 0)
    with pytest.raises(ValueError, match="kind"):
        exact_tasks.make_task(tok, 1000, "riddle", 0.5, 0)
    with pytest.raises(ValueError, match="room"):
        exact_tasks.make_task(tok, 60, "signature", 0.5, 0)
    with pytest.raises(ValueError, match="not installed"):
        exact_tasks.haystack_files("no-such-distribution-kvjax")
