"""The front end: the caller's process side of the engine (requests in, outputs out)."""
