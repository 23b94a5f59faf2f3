"""tracerl."""
