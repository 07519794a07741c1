"""How jobs share the queues and what they call: groups (`groups`: round-robin and a concurrency cap per tenant) and
the declaration of a cluster-wide rate limit (`rates`; the limiter is `pipeline.scheduling.ratelimit`)."""
