"""What an InferenceCluster may be: the rules (validation, pod policy), the API server's dry run
of its pods, and the validating webhook that answers the API server with them."""
