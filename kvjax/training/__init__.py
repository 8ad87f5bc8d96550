"""Training the bundled tiny models: a fast training forward, the data windows, phases and a resumable state."""
