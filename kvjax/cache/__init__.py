"""Per-request state as immutable pytrees: dense KV and rings (Llama family), the hybrid forms (DeepSeek-V4), the
lossy draft forms, and the static capacity buckets."""
