"""Cache pytrees of any model family as named arrays (and back), for remote prefix entries.

Leaves are named by their tree path (`jax.tree_util.keystr`, e.g. `.window.kv`), so nothing here knows a family's
cache classes. Three pieces:

- Leaf encodings, chosen per leaf and exact to the bit (bit patterns are compared, so -0.0 and NaN payloads
  survive): "fill" (every element has the same bits: only the value is stored — an empty ring, a position array of
  -1s), "rows" (at least a quarter of the rows along the last axis are all-zero bits: a packed row mask plus the
  other rows — unused capacity, entries a lossy draft dropped), "raw".
- The full cache, per layer: a family's full cache is a dataclass with a `layers` tuple (one bundle per layer, so
  it streams layer by layer) and other leaves (the token count: stored with the head). It is rebuilt against a
  template, the abstract `family.init_cache(config, 1, capacity, dtype)` of the serving capacity: a stored leaf may
  be shorter than the template's (a prefill leaves everything past the prompt at init_cache's zeros, so storing
  trims those regions, `trim_to`) and is padded back with zeros.
- A draft cache's structure as JSON: registered dataclasses by `module:qualname` (kvjax modules only) with their
  static fields, tuples, None, and leaves by name — enough to rebuild it without pickling.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CorruptEntry

ROWS_MIN_EMPTY = 0.25  # encode as "rows" when at least this fraction of the rows is zero


def leaf_names(tree) -> list[tuple[str, object]]:
    """(name, leaf) of every array leaf in flatten order; name = the leaf's key path."""
    return [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_leaves_with_path(tree)]


def _dtype(name: str) -> np.dtype:
    """A dtype from its name ("float32", "bfloat16", "int32", ...; NumPy alone does not know bfloat16)."""
    return np.dtype(jnp.dtype(name))


def _as(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` read as `dtype` (a store hands bfloat16 back as raw 2-byte values: same bits)."""
    if a.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"array of {a.dtype}, expected {dtype}")
    return a.view(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    """The elements' bit patterns as unsigned integers of the same width."""
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


# ---------------------------------------------------------------------------------------------------- leaves
def encode_leaf(name: str, a) -> tuple[dict, dict[str, np.ndarray]]:
    """(spec for the manifest, arrays for the bundle) of one leaf; `decode_leaf` inverts it bit for bit."""
    a = np.asarray(a)
    spec = {"shape": list(a.shape), "dtype": a.dtype.name}
    bits = _bits(a).reshape(-1)
    if bits.size and np.all(bits == bits[0]):
        return dict(spec, enc="fill", bits=int(bits[0])), {}
    if a.ndim >= 2:
        rows = _bits(a).reshape(-1, a.shape[-1])
        used = np.any(rows != 0, axis=1)
        if np.mean(~used) >= ROWS_MIN_EMPTY:
            return (dict(spec, enc="rows", rows=int(used.sum())),
                    {f"{name}#mask": np.packbits(used), f"{name}#rows": a.reshape(-1, a.shape[-1])[used]})
    return dict(spec, enc="raw"), {name: a}


def decode_leaf(name: str, spec: dict, arrays: dict) -> np.ndarray:
    """The leaf `encode_leaf` encoded. Raises CorruptEntry on an unknown encoding or inconsistent arrays."""
    try:
        shape, dtype, enc = tuple(spec["shape"]), _dtype(spec["dtype"]), spec["enc"]
        if enc == "fill":
            return np.full(shape, spec["bits"], f"u{dtype.itemsize}").view(dtype)
        if enc == "rows":
            D = shape[-1]
            n_rows = int(np.prod(shape[:-1], dtype=np.int64))
            used = np.unpackbits(arrays[f"{name}#mask"], count=n_rows).astype(bool)
            out = np.zeros((n_rows, D), dtype)
            out[used] = _as(arrays[f"{name}#rows"], dtype).reshape(-1, D)
            return out.reshape(shape)
        if enc == "raw":
            a = _as(arrays[name], dtype)
            if a.shape != shape:
                raise ValueError(f"array {a.dtype}{a.shape}, manifest says {dtype}{shape}")
            return a
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptEntry(f"leaf {name}: cannot decode ({type(e).__name__}: {e})") from None
    raise CorruptEntry(f"leaf {name}: unknown encoding {enc!r}")


def encode_tree(tree) -> tuple[dict, dict[str, np.ndarray]]:
    """({leaf name: spec}, bundle arrays) of every leaf of `tree`."""
    specs, arrays = {}, {}
    for name, a in leaf_names(tree):
        specs[name], arr = encode_leaf(name, a)
        arrays.update(arr)
    return specs, arrays


def _trim(a: np.ndarray, shape) -> np.ndarray:
    """`a` cut to `shape` where everything cut away is zero bits; otherwise `a` unchanged."""
    if shape is None or tuple(shape) == a.shape or len(shape) != a.ndim or any(s > n for s, n in zip(shape, a.shape)):
        return a
    cut = a[tuple(slice(0, s) for s in shape)]
    zero = _bits(a).copy()
    zero[tuple(slice(0, s) for s in shape)] = 0
    return cut if not np.any(zero) else a


def _fit(name: str, a: np.ndarray, like) -> np.ndarray:
    """A stored leaf placed in its template's shape: zero-padded where shorter (what init_cache holds there)."""
    if a.dtype != np.dtype(like.dtype) or a.ndim != len(like.shape) or any(
            s > n for s, n in zip(a.shape, like.shape)):
        raise CorruptEntry(f"leaf {name}: stored {a.dtype}{a.shape} does not fit {np.dtype(like.dtype)}"
                           f"{tuple(like.shape)}")
    if a.shape == tuple(like.shape):
        return a
    return np.pad(a, [(0, n - s) for s, n in zip(a.shape, like.shape)])


# ---------------------------------------------------------------------------------------------------- full cache
def _head_part(cache):
    """The full cache without its layers (the leaves stored with the head: the token count)."""
    return dataclasses.replace(cache, layers=())


def head_specs(full) -> dict:
    """Inline specs of the full cache's non-layer leaves (the token count).

    Raises:
        ValueError: a non-layer leaf is not one repeated value (the format streams per-layer state only).
    """
    specs, arrays = encode_tree(_head_part(full))
    if arrays:
        raise ValueError(f"full-cache leaves {sorted(specs)} outside `layers` hold more than one value")
    return specs


def layer_bundles(full, trim_to=None):
    """Yield (specs, arrays) of each layer of a batch-1 full cache, in layer order.

    Args:
        trim_to: optional abstract cache of the same structure (e.g. `init_cache` at capacity = prompt length):
            leaves are cut to its shapes where the cut part is zero bits.
    """
    for i, layer in enumerate(full.layers):
        if trim_to is not None:
            shapes = [a.shape for a in jax.tree.leaves(trim_to.layers[i])]
            layer = jax.tree.unflatten(jax.tree.structure(layer),
                                       [_trim(np.asarray(a), s) for a, s in zip(jax.tree.leaves(layer), shapes)])
        yield encode_tree(layer)


def decode_layer(template_layer, specs: dict, arrays: dict):
    """One layer of the full cache, on the device, in the template layer's structure and shapes."""
    names = [n for n, _ in leaf_names(template_layer)]
    if sorted(specs) != sorted(names):
        raise CorruptEntry(f"stored layer has leaves {sorted(specs)}, the model's cache has {sorted(names)}")
    leaves = [jnp.asarray(_fit(name, decode_leaf(name, specs[name], arrays), like))
              for name, like in leaf_names(template_layer)]
    return jax.tree.unflatten(jax.tree.structure(template_layer), leaves)


def assemble_full(template, layers, head: dict):
    """The full cache from its decoded layers and the non-layer leaves' inline specs, in the template's structure."""
    return dataclasses.replace(decode_layer(_head_part(template), head, {}), layers=tuple(layers))


# ---------------------------------------------------------------------------------------------------- structure
def _is_node(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def structure(tree, prefix: str = "") -> object:
    """JSON description of a cache pytree: dataclass nodes by type and static fields, tuples, None, named leaves."""
    if tree is None:
        return None
    if isinstance(tree, (tuple, list)):
        return {"tuple": [structure(c, f"{prefix}[{i}]") for i, c in enumerate(tree)]}
    if _is_node(tree):
        cls = type(tree)
        static, fields = {}, {}
        for f in dataclasses.fields(tree):
            v = getattr(tree, f.name)
            if f.metadata.get("static"):
                static[f.name] = static_json(v)
            else:
                fields[f.name] = structure(v, f"{prefix}.{f.name}")
        return {"type": f"{cls.__module__}:{cls.__qualname__}", "static": static, "fields": fields}
    return {"leaf": prefix}


def static_json(v):
    """A static field's value as JSON: plain values as they are, a frozen dataclass (e.g. the refreshing drafter's
    `RefreshSpec`) by type and fields, a tuple tagged so it comes back a tuple (static fields must stay hashable)."""
    if _is_node(v):
        cls = type(v)
        return {"static_type": f"{cls.__module__}:{cls.__qualname__}",
                "values": {f.name: static_json(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}}
    if isinstance(v, tuple):
        return {"static_tuple": [static_json(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"static field value of type {type(v).__name__} has no stored form")


def static_value(d):
    """Inverse of `static_json`. Raises CorruptEntry on an unknown type."""
    try:
        if isinstance(d, dict) and "static_type" in d:
            cls = _resolve(d["static_type"])
            return cls(**{k: static_value(v) for k, v in d.get("values", {}).items()})
        if isinstance(d, dict) and "static_tuple" in d:
            return tuple(static_value(x) for x in d["static_tuple"])
    except (TypeError, AttributeError) as e:
        raise CorruptEntry(f"bad static value {d!r}: {e}") from None
    if isinstance(d, (dict, list)):
        raise CorruptEntry(f"bad static value {d!r}")
    return d


def _resolve(name: str) -> type:
    module, _, qual = name.partition(":")
    if not module.startswith("kvjax."):
        raise CorruptEntry(f"cache node type {name!r} is not a kvjax type")
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise CorruptEntry(f"cache node type {name!r} does not exist") from None
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise CorruptEntry(f"cache node type {name!r} is not a dataclass")
    return obj


def rebuild(desc, leaves: dict):
    """Inverse of `structure`: the pytree with `leaves[name]` at every leaf. Raises CorruptEntry on a bad desc."""
    if desc is None:
        return None
    if not isinstance(desc, dict):
        raise CorruptEntry(f"bad cache structure node {desc!r}")
    if "tuple" in desc:
        return tuple(rebuild(c, leaves) for c in desc["tuple"])
    if "leaf" in desc:
        if desc["leaf"] not in leaves:
            raise CorruptEntry(f"leaf {desc['leaf']} is missing from the stored entry")
        return leaves[desc["leaf"]]
    cls = _resolve(desc.get("type", ""))
    kw = {k: rebuild(v, leaves) for k, v in desc.get("fields", {}).items()}
    try:
        return cls(**kw, **{k: static_value(v) for k, v in desc.get("static", {}).items()})
    except TypeError as e:
        raise CorruptEntry(f"cannot rebuild {desc['type']}: {e}") from None


def encode_draft(dcache) -> tuple[dict, dict[str, np.ndarray]]:
    """({"structure": ..., "leaves": {name: spec}}, bundle arrays) of a draft cache."""
    specs, arrays = encode_tree(dcache)
    return {"structure": structure(dcache), "leaves": specs}, arrays


def decode_draft(desc: dict, arrays: dict):
    """The draft cache `encode_draft` described, on the device."""
    try:
        specs = desc["leaves"]
        leaves = {n: jnp.asarray(decode_leaf(n, s, arrays)) for n, s in specs.items()}
        return rebuild(desc["structure"], leaves)
    except (KeyError, TypeError) as e:
        raise CorruptEntry(f"draft entry: bad description ({type(e).__name__}: {e})") from None
