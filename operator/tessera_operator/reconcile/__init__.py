"""The reconcile path: kopf handlers -> work queue -> Reconciler (read -> admit -> observe -> plan
-> write -> report). `observe`, `planner`, `restart`, `rollout`, `owned_plans` and `status` are
pure; `writes` and `events` hold the API calls that apply a plan."""
