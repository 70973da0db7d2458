"""Root pytest configuration: shared fixtures live in their own plugin modules."""

import os

# Two cores: every test process keeps torch to a fixed, small thread count.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["tests.fixtures.models", "e2e.fixtures"]
