"""`tessera bench serve`: load a running server the way `vllm bench serve` does."""
