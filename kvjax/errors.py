"""Every error kvjax raises on purpose. Each names the thing at fault and what was expected."""

from __future__ import annotations


class KvjaxError(Exception):
    """Base of every kvjax error."""


class UnsupportedConfigError(KvjaxError, ValueError):
    """A config field names something kvjax does not implement."""


class UnsupportedFeatureError(KvjaxError, NotImplementedError):
    """A model family cannot do what was asked (names the family and the feature)."""

    def __init__(self, family: str, feature: str, hint: str = ""):
        self.family, self.feature = family, feature
        super().__init__(f"model family {family!r} does not support {feature}" + (f": {hint}" if hint else ""))


class WeightsError(KvjaxError, ValueError):
    """A checkpoint does not match the config: names the tensor and what was expected."""


class CapacityError(KvjaxError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the largest cache capacity."""


class BudgetError(KvjaxError, ValueError):
    """A request cannot fit the device-memory budget even alone."""


class CorruptEntry(KvjaxError, ValueError):
    """A stored cache entry failed verification (checksum, header, shape, identity): a miss, never a token."""


class StaleLease(KvjaxError, RuntimeError):
    """A plan's lease no longer holds (an entry it pinned changed): the plan must be re-made."""


class InputError(KvjaxError, ValueError):
    """Bad user input (token ids, sampling parameters, lengths): names the argument and what was expected."""
