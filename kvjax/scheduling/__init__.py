"""Many requests: requests and results, the device-memory budget, batched drafting, staggered verification."""
