"""Fair shares of the queues: groups (`groups`)."""
