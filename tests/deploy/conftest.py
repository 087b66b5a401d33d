"""Marker of the deployment tests: deselect them with ``pytest -m "not deploy"``."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "deploy: real SuperLink and SuperNode processes on 127.0.0.1 (minutes; "
        'deselect with -m "not deploy")',
    )
