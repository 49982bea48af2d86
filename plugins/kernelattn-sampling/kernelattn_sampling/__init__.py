"""kernelattn-sampling: importance-sampling estimators of softmax attention.

Registry names: ``ra`` (unbiased randomized attention), ``ra-biased`` (its mean-index
variant), ``rfa-snis`` (random feature attention read as self-normalised importance
sampling) and ``lara`` (linear randomized attention, self-normalised multiple
importance sampling). See Zheng, Wang & Kong, "Linear Complexity Randomized
Self-attention Mechanism", ICML 2022, and the spec ``specs/003_lara.md``.
"""

from .estimators import RFASNIS, LinearRandomizedAttention, RandomizedAttention, RandomizedAttentionBiased

__all__ = ["RFASNIS", "LinearRandomizedAttention", "RandomizedAttention", "RandomizedAttentionBiased"]
