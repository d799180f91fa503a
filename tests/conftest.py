"""Suite-wide pytest setup. Each area keeps its fixtures in tests/<area>/conftest.py."""
