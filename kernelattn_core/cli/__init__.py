"""The ``kernelattn`` command line: ``plugins``, ``compare``, ``verify``."""
