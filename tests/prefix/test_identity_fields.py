"""Bug class 10: the namespace names everything that changes the bytes: tokenizer and chat-template revisions as
content hashes, kernel ABI, attention implementation, mesh, device kind, JAX/jaxlib versions, and adapters as a
list of (content fingerprint, scale)."""

import dataclasses

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import pallas_kernels
from kvjax.errors import InputError
from kvjax.prefix import runtime_identity
from kvjax.prefix.runtime_identity import KERNEL_ABI
from kvjax.prefix.prefill import model_namespace
from kvjax.remote import prefix_entry as pe
from kvjax.tokenizer import Tokenizer


def _tokenizer(chars: str, template: str | None):
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    tok = Backend(models.WordLevel({c: i for i, c in enumerate(["[UNK]", *chars])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return Tokenizer(tok, {"eos_token": "[UNK]"}, template)


def test_tokenizer_and_template_revisions_are_content_hashes(model, make_cache):
    pc = make_cache(model)
    t1 = _tokenizer("abc", "{{ messages }}")
    same = _tokenizer("abc", "{{ messages }}")
    other_vocab = _tokenizer("abd", "{{ messages }}")
    other_template = _tokenizer("abc", "{{ messages }}!")
    ns = {k: model_namespace(dataclasses.replace(model, tokenizer=t), pc)
          for k, t in [("t1", t1), ("same", same), ("vocab", other_vocab), ("template", other_template)]}
    assert ns["t1"].semantic["tokenizer_rev"] and ns["t1"].semantic["template_rev"]
    assert ns["t1"].hex == ns["same"].hex
    assert ns["vocab"].diff(ns["t1"]) == ["semantic.tokenizer_rev"]
    assert ns["template"].diff(ns["t1"]) == ["semantic.template_rev"]
    assert model_namespace(model, pc).semantic["tokenizer_rev"] == ""  # no tokenizer: nothing to hash


def test_runtime_fields_are_part_of_the_namespace(model, make_cache):
    pc = make_cache(model)
    for rep in (model_namespace(model, pc).representation, pe.prefix_namespace(model).representation):
        assert rep["kernel_abi"] == KERNEL_ABI
        assert rep["attention"] == model.attention  # the implementation the computation names
        assert rep["device_kind"] == jax.devices()[0].device_kind and rep["platform"] == jax.devices()[0].platform
        assert rep["jax"] == jax.__version__ and rep["jaxlib"] == jaxlib.__version__
        assert rep["mesh"] == "single-device"
        assert rep["native"] == runtime_identity.native_field()
        assert (rep["native"] == "none") == (not pallas_kernels.native.available())


def test_sharded_params_name_their_mesh(model, make_cache):
    pc = make_cache(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharded = dataclasses.replace(model, params=jax.tree.map(lambda x: jax.device_put(x, spec), model.params))
    a, b = model_namespace(model, pc), model_namespace(sharded, pc)
    assert b.diff(a) == ["representation.mesh"] and "tp" in b.representation["mesh"]


def test_a_store_shared_by_a_gpu_host_and_a_cpu_host_never_mixes_them(model, make_cache, run, cold, prompt,
                                                                      tmp_path, monkeypatch):
    from kvjax.prefix import model_identity

    url = str(tmp_path / "store")
    p = prompt(80)
    real = model_identity.runtime_fields
    monkeypatch.setattr(model_identity, "runtime_fields",
                        lambda *a: {**real(*a), "device_kind": "NVIDIA H200", "platform": "gpu"})
    gpu = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    run(model, gpu, p)
    gpu.flush()
    monkeypatch.setattr(model_identity, "runtime_fields", real)
    cpu = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    got, plan = run(model, cpu, p)
    assert plan.boundary == 0
    assert plan.shortfalls[0].cause == "identity" and "representation.device_kind" in plan.shortfalls[0].detail
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)


def test_adapters_are_content_fingerprints_with_scales(model, make_cache):
    pc = make_cache(model)
    lora = {"a": jnp.ones((4, 2)), "b": jnp.full((2, 4), 0.5)}
    lora2 = {"a": jnp.ones((4, 2)) * 3, "b": jnp.full((2, 4), 0.5)}

    def ns(adapters):
        return model_namespace(model, pc, adapters=adapters)

    base = ns([(lora, 0.5)])
    assert base.hex == ns([({k: jnp.array(v) for k, v in lora.items()}, 0.5)]).hex  # same content, new objects
    assert base.hex != ns([]).hex and base.hex != ns([(lora, 1.0)]).hex and base.hex != ns([(lora2, 0.5)]).hex
    both = ns([(lora, 0.5), (lora2, 1.0)])
    assert both.hex != ns([(lora2, 1.0), (lora, 0.5)]).hex and both.hex != base.hex
    assert both.semantic["adapters"][0][1] == 0.5 and len(both.semantic["adapters"]) == 2
    before = base.hex
    lora["b"] = lora["b"] + 1  # updated in place: the same "adapter" object is a different adapter
    assert ns([(lora, 0.5)]).hex != before
    with pytest.raises(InputError, match="adapter"):
        ns([("my-lora", 1.0)])  # a name is not an identity
    with pytest.raises(InputError, match="scale"):
        ns([(lora, "high")])
    assert pe.prefix_namespace(model, adapters=[(lora, 0.5)]).semantic["adapters"] == \
        ns([(lora, 0.5)]).semantic["adapters"]


def test_a_model_run_with_another_attention_implementation_is_another_namespace(model, make_cache):
    import dataclasses

    pc = make_cache(model)
    default = model_namespace(model, pc)
    named = model_namespace(dataclasses.replace(model, attention="pallas_interpret"), pc)
    assert named.representation["attention"] == "pallas_interpret"
    assert named.diff(default) == ["representation.attention"]
