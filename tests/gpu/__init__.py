"""GPU-only tests: skipped without CUDA (see conftest.py and README.md)."""
