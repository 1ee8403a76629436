"""The tools that write the generated parts of docs/ (`make docs`), and that the tests import
to check those parts are current: the import graph and the traced request path in
ARCHITECTURE.md, and the configuration reference (CONFIGURATION.md) from `Settings`.

Run one from the repository's root: `python -m docs.tools.import_graph --write`.
"""
