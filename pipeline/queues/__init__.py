"""How a queue lies in Redis, for whoever writes or reads it: the broker, the producer, the worker's transport.

* `priority`: job priorities 0-9 and the list each level waits in (kombu's priority sub-queues).
* `wake`: the queue's wake-up marker list, pushed with each message, which idle workers wait on.
* `keys`: every key name of a queue, on a single Redis and on a Redis Cluster (the queue's hash tag).
* `jobkeys`: a job's keys outside its queue (its result, its record, its result's owner stamp; on a cluster the last
  two in the result's slot).
"""
