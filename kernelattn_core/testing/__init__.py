"""Testing support shipped with the core: the conformance kit for plugin authors."""
