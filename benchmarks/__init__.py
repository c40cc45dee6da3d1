"""The benchmarks: each a module run from the repository's root, ``python -m benchmarks.NAME`` (``--help``
lists its flags; ``make bench`` runs the main ones). What they share is in :mod:`benchmarks._harness`."""
