"""The import contracts `make lint` checks (pyproject.toml) and the tests that they catch what they say."""
