"""The prefix-cache manager: identity, radix tree, plans (routing vectors), leases, tiers, the store."""

from kvjax.prefix.manager import PrefixCache

__all__ = ["PrefixCache"]
