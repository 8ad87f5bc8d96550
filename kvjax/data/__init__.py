"""Training and evaluation data for the small bundled models (see `kvjax.data.corpus`)."""
