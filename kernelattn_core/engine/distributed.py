"""Old location of :mod:`kernelattn_core.distributed` (sequence-parallel attention), kept so
that ``from kernelattn_core.engine.distributed import sequence_parallel_attention`` keeps
working: this module *is* :mod:`kernelattn_core.distributed` once imported (same functions,
same exception classes).

Sequence-parallel attention runs a feature-map estimator across ranks: it is a client of
the estimators, not a part of the engine they call, so it sits at the package level, above
the built-ins (issue 27). Nothing in the core imports this alias; ``scripts/spine_metrics.py``
lists it under ``ALIASES``.
"""

import sys
from importlib import import_module

sys.modules[__name__] = import_module("kernelattn_core.distributed")
