"""The frozen plugins' own released test files are kept as written, not collected here:
they name the plugin "example", which in this suite is the *installed* tutorial plugin.
``test_compat.py`` runs verify and the kit on the frozen copies instead."""

collect_ignore_glob = ["*/released_tests/*"]
