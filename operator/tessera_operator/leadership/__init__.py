"""Leader election on a coordination.k8s.io/v1 Lease: only the leader reconciles and autoscales."""
