"""What several test files share: the tiny job's components and fit runner, recorders, test pools, the SGLang
stand-in server, and the distributed fit script. Imported as ``helpers.<module>`` (``tests/`` is on the path)."""
