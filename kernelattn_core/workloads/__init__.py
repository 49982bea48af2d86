"""Workloads for judging estimators: the real attention of a pretrained model.

See :mod:`kernelattn_core.workloads.minilm` (optional extra ``kernelattn-core[hf]``).
Importing this package imports neither ``transformers`` nor the model.
"""
