"""Pure forward functions over a params pytree; one file per model family."""
