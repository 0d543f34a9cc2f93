"""Registers the ``soak`` marker (the short soak runs in CI; ``make soak`` runs the long one)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: a bounded load test (tests/soak/soak.py); the short form runs in CI")
