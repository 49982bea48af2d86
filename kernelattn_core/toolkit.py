"""The published plugin toolkit (added within plugin spec 1.1): what a plugin may import from the core.

A plugin imports the top-level API (``import kernelattn_core as ka``: :func:`~kernelattn_core.create`,
the interfaces, the errors, :data:`~kernelattn_core.hookimpl`, ...) and this module; nothing
else of ``kernelattn_core``. What is listed in ``__all__`` keeps its name and meaning within a
spec major version: the core may move the code behind a name (the engine, the registry,
the report helpers), never the name. ``tests/test_architecture.py`` fails when a plugin of
this repository (or the tutorial's) imports anything else.

Every name is imported on first use (PEP 562), so ``from kernelattn_core.toolkit import
InputError`` in a plugin's module costs nothing heavy, and the test helpers (which import
pytest) load only when a test asks for them.

Groups
------
Interfaces and errors
    ``AttentionEstimator``, ``FeatureMap``, ``FusedFeatureSpec``, ``Kernel``, ``KernelFamily``,
    ``DotProductKernel``, ``ShiftInvariantKernel``, ``Normalizer``, ``StateOwner``,
    ``check_state``, ``check_state_tensor``, ``continues_state``, ``continued_sums`` (whether a
    short decoding step over running sums may continue a state); ``KernelAttnError``, ``InputError``,
    ``DomainError``, ``PluginError``, ``PluginWarning``, ``UnknownNameError``; ``hookimpl``.
Built-ins to build on
    ``ExactAttention``, ``FeatureMapAttention``, ``EluFeatureMap``, ``SoftmaxKernel``,
    ``RowNormalizer``, ``SignedRowNormalizer``.
Registry
    ``construct`` (build a class from options, naming unknown ones), ``get_registry``,
    ``resolve``, ``resolve_class`` (names to classes, at build time only).
Validation and randomness
    ``check_choice``, ``check_key_padding_mask``, ``check_positive_int``, ``check_qkv``,
    ``check_scale``, ``check_tensor``, ``masks_nothing`` (whether a step's padding mask pads
    none of its positions), ``one_position`` (whether a step's inputs are the one position
    a decoding short path planned for); ``RedrawPolicy``, ``generator_for``, ``recomputing``
    (whether a forward call is an activation-checkpoint recompute: advance no schedule and
    update no statistic then), ``checkpoint_token`` (which checkpointed call a forward
    call or recompute belongs to), ``PendingDraws`` (a checkpointed call's draws until
    its recompute), ``MapState`` (a feature map's buffers as one call saw them),
    ``same_draws``, ``after_backward`` and ``ReplayError`` (a recompute that cannot be
    matched).
Engine helpers
    references (``kernel_attention_naive``, ``feature_attention_naive``,
    ``decayed_linear_attention_naive``), the quarantine of
    non-finite rows (``all_finite``, ``allowed_pairs``, ``finite_rows``, ``isolated_pre``, ``isolated_rows``,
    ``non_finite_rows``, ``poison_rows``, ``quarantine_non_finite``), ``absorb_keys`` (and
    ``absorb_one_finite``, its one-key form without the quarantine),
    ``compute_dtype``, ``exp_nonpositive`` and ``exp_kept`` (stabilised exponentials that
    stay on the CPU's fast path; the second in place, with exp's own derivative),
    ``prefix_stabiliser`` (the causal-safe running maximum), the causal recurrence
    (``causal_linear_attention``, with its optional per-position log-decay), and
    the backends (``Backend``, ``Problem``, ``register_backend``,
    ``select_backend``, ``attend_features``, ``attend_normalized``).
Claims and verification
    every claim type of :mod:`kernelattn_core.claims`, ``ClaimDeprecationWarning`` (what a
    claim in a deprecated form warns with, to filter or assert in a plugin's tests),
    ``check_claim``, ``z_threshold``.
Experiments and reports
    ``Experiment``, ``add_output_arguments``, ``check_plot``, ``write_results``;
    ``median_time``, ``peak_memory``, ``line_panels``, ``boxplots``, ``grouped_bars``.
Testing kit
    ``conformance_tests``, ``conformance_cases`` (the same checks as plain callables, for
    use outside pytest), ``fuzz_tests``, ``fuzz_tensors`` (the fuzzer's ``q, k, v``
    generator), ``cli_main`` (run the ``kernelattn`` command in-process).
"""

from __future__ import annotations

from importlib import import_module

#: published name -> (module, attribute there)
_EXPORTS: dict[str, tuple[str, str]] = {
    # interfaces and errors
    **{n: ("kernelattn_core.errors", n) for n in ("DomainError", "InputError", "KernelAttnError", "ReplayError")},
    **{n: ("kernelattn_core.errors", n) for n in ("PluginError", "PluginWarning", "UnknownNameError")},
    "hookimpl": ("kernelattn_core.hookspecs", "hookimpl"),
    **{
        n: ("kernelattn_core.interfaces", n)
        for n in (
            "AttentionEstimator",
            "DotProductKernel",
            "FeatureMap",
            "FusedFeatureSpec",
            "Kernel",
            "KernelFamily",
            "Normalizer",
            "ShiftInvariantKernel",
        )
    },
    **{
        n: ("kernelattn_core.interfaces.state", n)
        for n in ("StateOwner", "check_state", "check_state_tensor", "continued_sums", "continues_state")
    },
    # built-ins
    **{
        n: ("kernelattn_core.builtins", n)
        for n in (
            "EluFeatureMap",
            "ExactAttention",
            "FeatureMapAttention",
            "RowNormalizer",
            "SignedRowNormalizer",
            "SoftmaxKernel",
        )
    },
    # registry
    **{n: ("kernelattn_core.registry", n) for n in ("construct", "get_registry", "resolve", "resolve_class")},
    # validation and randomness
    **{
        n: ("kernelattn_core.validation", n)
        for n in (
            "check_choice",
            "check_key_padding_mask",
            "check_positive_int",
            "check_qkv",
            "check_scale",
            "check_tensor",
            "masks_nothing",
            "one_position",
        )
    },
    **{
        n: ("kernelattn_core.redraw", n)
        for n in (
            "MapState",
            "PendingDraws",
            "RedrawPolicy",
            "after_backward",
            "checkpoint_token",
            "generator_for",
            "recomputing",
            "same_draws",
        )
    },
    # engine helpers
    **{
        n: ("kernelattn_core.engine.naive", n)
        for n in (
            "allowed_pairs",
            "decayed_linear_attention_naive",
            "feature_attention_naive",
            "isolated_pre",
            "kernel_attention_naive",
            "poison_rows",
            "quarantine_non_finite",
        )
    },
    **{n: ("kernelattn_core.validation", n) for n in ("all_finite", "finite_rows", "isolated_rows", "non_finite_rows")},
    **{n: ("kernelattn_core.engine.torch_backend", n) for n in ("absorb_keys", "absorb_one_finite", "compute_dtype")},
    "causal_linear_attention": ("kernelattn_core.engine.chunked", "causal_linear_attention"),
    "exp_kept": ("kernelattn_core.engine.chunked", "exp_kept"),
    "exp_nonpositive": ("kernelattn_core.engine.chunked", "exp_nonpositive"),
    "prefix_stabiliser": ("kernelattn_core.engine.chunked", "prefix_stabiliser"),
    **{
        n: ("kernelattn_core.engine.backends", n)
        for n in ("Backend", "Problem", "attend_features", "attend_normalized", "register_backend", "select_backend")
    },
    # claims and verification
    **{
        n: ("kernelattn_core.claims", n)
        for n in (
            "Claim",
            "ConsistentAttention",
            "EngineReference",
            "ErrorDecay",
            "EstimateVariance",
            "KernelClosedForm",
            "KernelMatchesExpression",
            "MaclaurinCoefficients",
            "NonNegativeCoefficients",
            "PaddingInvariance",
            "PmfSumsToOne",
            "PositiveDefinite",
            "PositiveFeatures",
            "PrefixInvariance",
            "QuadratureIdentity",
            "RuntimeIdentity",
            "SpectralDensityIntegral",
            "SymbolicExpectation",
            "UnbiasedAttention",
            "UnbiasedKernelEstimate",
        )
    },
    "ClaimDeprecationWarning": ("kernelattn_core.claims", "ClaimDeprecationWarning"),
    "check_claim": ("kernelattn_core.verify", "check_claim"),
    "z_threshold": ("kernelattn_core.verify.result", "z_threshold"),
    # experiments and reports
    **{
        n: ("kernelattn_core.experiments", n)
        for n in ("Experiment", "add_output_arguments", "check_plot", "write_results")
    },
    **{n: ("kernelattn_core.report.measure", n) for n in ("median_time", "peak_memory")},
    **{n: ("kernelattn_core.report.plot", n) for n in ("boxplots", "grouped_bars", "line_panels")},
    # testing kit
    **{n: ("kernelattn_core.testing", n) for n in ("conformance_cases", "conformance_tests", "fuzz_tests")},
    "fuzz_tensors": ("kernelattn_core.testing.fuzz", "_tensors"),
    "cli_main": ("kernelattn_core.cli.main", "main"),
}

#: the version of the plugin spec that introduced the toolkit
TOOLKIT_SPEC = "1.1"

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: it is not part of the published plugin toolkit"
        ) from None
    value = getattr(import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
