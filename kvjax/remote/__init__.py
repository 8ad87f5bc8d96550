"""Remote prefix caching (VeriCache's second setting): a prefix's full and draft caches live in a store; serving
fetches the small draft cache first, drafts while the full cache streams in, and verifies every emitted token."""

from kvjax.remote.link import Link
from kvjax.errors import CorruptEntry
from kvjax.remote.store_client import RemoteStore

__all__ = ["CorruptEntry", "Link", "RemoteStore"]
