"""The store contract: one behaviour suite every storage engine passes (see conftest.py)."""
