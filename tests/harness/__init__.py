"""What the tests run workers, services and aggregators with: each test
folder imports these as ``harness.NAME`` (tests/ is on the path)."""
