"""Request plumbing: dependencies, the gate, error bodies, JSON bodies, rate limits, admission, priority, paging,
and the Python client of the HTTP API."""
