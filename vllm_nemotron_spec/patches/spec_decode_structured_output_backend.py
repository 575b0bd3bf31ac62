"""Patch: a guided request on a server whose structured-outputs backend cannot follow speculative
decoding gets a clear 400 instead of a failed request.

Why:     Under speculative decoding the grammar must be rolled back over rejected draft tokens.
         vLLM's ``lm-format-enforcer`` backend cannot: its ``compile_grammar`` raises inside the
         engine, after the request was accepted, and the request ends as an engine-side error
         (``FINISHED_ERROR``) instead of a validation error naming the option. xgrammar, guidance
         and outlines roll back (``max_rollback_tokens``); they are unchanged.
How:     ``SamplingParams.verify`` (the front end's per-request validation) first raises
         ``VLLMValidationError`` (HTTP 400) for a request with ``structured_outputs`` when the
         engine drafts with a Nemotron 3.5 draft the plugin routes and the backend is
         ``lm-format-enforcer``, naming ``--structured-outputs-config.backend`` and the backends
         that work. Everything else goes to upstream's ``verify`` untouched.
Upstream: none known to us; vLLM 0.32/0.33 raise in ``LMFormatEnforcerBackend.compile_grammar``.
Removal: when upstream validates the combination per request or lm-format-enforcer rolls back;
         ``tests/patches/test_spec_decode_structured_output_backend.py`` checks upstream's
         backend still raises.
"""

from __future__ import annotations

from vllm_nemotron_spec.patches import Target, replace_when_imported
from vllm_nemotron_spec.target_hook import routed_architecture

TARGET_MODULE = "vllm.sampling_params"
TARGET_SYMBOL = "SamplingParams.verify"
NO_ROLLBACK_BACKENDS = ("lm-format-enforcer",)

TARGETS = (Target(TARGET_MODULE, TARGET_SYMBOL, {"7f24d64306afb254": "0.32.0, 0.33.0"}),)


def refusal(backend: str, method: str | None) -> str:
    return (
        f"structured_outputs: the structured-outputs backend {backend!r} "
        f"(--structured-outputs-config.backend) cannot roll back rejected draft tokens, so it "
        f"cannot guide speculative decoding ({method or 'speculative'} drafts, "
        "--speculative-config); start the server with backend xgrammar, guidance, outlines "
        "or auto"
    )


def check(params, speculative_config, structured_outputs_config) -> None:
    """Raise ``VLLMValidationError`` for a guided request the backend cannot serve under
    speculative decoding."""
    if (
        params.structured_outputs is None
        or speculative_config is None
        or structured_outputs_config is None
        or routed_architecture(speculative_config) is None
    ):
        return
    backend = getattr(structured_outputs_config, "backend", None)
    if backend in NO_ROLLBACK_BACKENDS:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            refusal(backend, getattr(speculative_config, "method", None)),
            parameter="structured_outputs",
        )


def make_verify(upstream):
    import inspect

    signature = inspect.signature(upstream)
    if not {"speculative_config", "structured_outputs_config"} <= set(signature.parameters):
        raise TypeError(f"SamplingParams.verify{signature} lacks the parameters this patch reads")

    def verify(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        check(self, bound.get("speculative_config"), bound.get("structured_outputs_config"))
        return upstream(self, *args, **kwargs)

    return verify


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1], TARGET_MODULE, "SamplingParams", "verify", make_verify
    )
