"""Registers the ``crash`` marker (a short crash test runs in CI; ``make crash`` runs the long ones)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "crash: the randomised crash test (tests/crash/crash.py); the short form runs "
                                       "in CI")
