"""Old location of :func:`kernelattn_core.kernel_attention` (deprecated: import it from
``kernelattn_core``).

``kernel_attention`` is defined beside :func:`~kernelattn_core.create` in
:mod:`kernelattn_core.api` (issue 27, "one spine"): it dispatches on the built-in
estimators, so it sits above them, and the engine below imports neither. Importing this
module warns (:class:`DeprecationWarning`) and gives :mod:`kernelattn_core.api` itself.
Nothing in the core imports this alias; ``scripts/spine_metrics.py`` lists it under
``ALIASES``.
"""

import sys
import warnings
from importlib import import_module

warnings.warn(
    "kernelattn_core.engine.api is deprecated: import kernel_attention from kernelattn_core",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = import_module("kernelattn_core.api")
