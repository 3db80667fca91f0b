"""Shared pieces of the test suite: small models, rank functions the distributed tests
spawn, the scripts they launch, and readings that stand in for measured speeds. Test
modules import from here (``from helpers.models import mlp``), never from each other;
pytest puts ``tests/`` on the path (``pythonpath`` in pyproject.toml)."""
