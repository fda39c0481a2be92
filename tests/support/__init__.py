"""Support code of the tests (no tests here): real processes and servers, the cluster factory,
the transformers oracle, bounded waits and free ports. `tests/` is on pytest's pythonpath, so
tests import it as `support.<module>`."""
