"""Old location of :mod:`kernelattn_core.verify.targets` (:func:`measured_targets`,
:class:`Targets`), kept so that ``from kernelattn_core.claims.targets import
measured_targets`` keeps working: this module *is* :mod:`kernelattn_core.verify.targets`
once imported.

:func:`measured_targets` builds the estimator a name stands for (``create``) to read its
kernel: a measurement, not a claim. The claims are data at the interfaces layer and resolve
no names (issue 27), so it sits with the checkers. Nothing in the core imports this alias;
``scripts/spine_metrics.py`` lists it under ``ALIASES``.
"""

import sys
from importlib import import_module

sys.modules[__name__] = import_module("kernelattn_core.verify.targets")
