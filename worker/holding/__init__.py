"""Which queues a worker holds: claims, renewals, fair shares, hand-backs, the held queues'
life cycle, aside queues drained, and the watchers of deferred gaps."""
