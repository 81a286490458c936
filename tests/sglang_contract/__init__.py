"""Contract tests of lit_parl's SGLang pool against SGLang's own code (``make test-sglang``, .venv-sglang).

A package, so that its ``conftest.py`` and test modules do not shadow ``tests/conftest.py`` (``from conftest
import ...``) or the modules of ``tests/`` with the same names.
"""
