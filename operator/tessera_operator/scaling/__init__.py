"""Queue-depth autoscaling: reading the leaders' gauge (queue_metrics), the decision (autoscaler)
and the pure scaling step of a pass (plan); the reconciler applies what it plans."""
