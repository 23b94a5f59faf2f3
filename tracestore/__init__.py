"""tracestore."""
