"""Bug class 9: an empty prompt plans nothing (boundary 0, no shortfall), on every form set."""

import numpy as np
import pytest

from builders import toy_config, toy_model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.prefix.prefill import model_namespace


@pytest.mark.parametrize("types", [(FULL, FULL), (FULL, SLIDING)])
def test_lookup_of_an_empty_prompt(make_cache, run, prompt, types, pins):
    model = toy_model(toy_config(types, window=20))
    pc = make_cache(model)
    run(model, pc, prompt(40))
    plan = pc.lookup(model_namespace(model, pc), np.zeros((0,), np.int32))
    assert (plan.prompt_tokens, plan.matched, plan.boundary, plan.shortfalls) == (0, 0, 0, [])
    cache, plan = pc.execute(plan, pc.forms.new_cache(256))
    plan.lease.release()
    assert int(cache.length[0]) == 0 and pins(pc) == 0
    assert pc.stats()["prompt_tokens"] == 40
