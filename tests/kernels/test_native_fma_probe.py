"""The multiply-add probe benchmarks divide a step's multiply-adds by (its arithmetic floor): a rate on one or more
threads, bad arguments refused, and not part of the digest that names the kernels' arithmetic."""

from __future__ import annotations

import math

import pytest

from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library did not build here")


def test_the_rate_is_a_positive_number_of_multiply_adds_per_second_on_any_number_of_threads():
    for threads in (1, 2):
        rate = native.multiply_add_rate(threads=threads, seconds=0.02)
        # finite and plausible: even a build without FMA instructions (std::fma in software, one lane) does over
        # a million a second
        assert math.isfinite(rate) and rate > 1e6, (threads, rate)


@pytest.mark.parametrize("threads,seconds", [(0, 0.1), (1, 0.0), (1, -1.0)])
def test_bad_arguments_are_refused(threads, seconds):
    with pytest.raises(ValueError, match="threads must be >= 1 and seconds > 0"):
        native.multiply_add_rate(threads=threads, seconds=seconds)


def test_the_probe_is_built_in_but_left_out_of_the_arithmetic_digest():
    assert any(p.name == "fma_probe.cc" for p in native.SOURCES)
    assert all(p.name != "fma_probe.cc" for p in native.KERNEL_SOURCES)
    assert set(native.KERNEL_SOURCES) == set(native.SOURCES) - {native.HERE / "fma_probe.cc"}
