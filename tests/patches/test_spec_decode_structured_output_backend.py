"""The structured-outputs backend patch: guided requests on an lm-format-enforcer engine with
speculative decoding are refused by ``SamplingParams.verify`` (HTTP 400), everything else goes to
upstream's ``verify``; and a tripwire on the upstream backend that cannot roll back."""

from __future__ import annotations

import inspect
import types

import pytest

from vllm_nemotron_spec.patches import spec_decode_structured_output_backend as patch


def _upstream_verify():
    from vllm.sampling_params import SamplingParams

    return getattr(SamplingParams.verify, "__wrapped__", SamplingParams.verify)


def test_tripwire_lm_format_enforcer_cannot_roll_back():
    """Upstream's lm-format-enforcer backend still raises for speculative tokens, xgrammar still
    rolls back; when this fails, re-read the backends before changing NO_ROLLBACK_BACKENDS."""
    from vllm.v1.structured_output import backend_lm_format_enforcer, backend_xgrammar

    assert "does not support speculative tokens" in inspect.getsource(backend_lm_format_enforcer)
    assert "max_rollback_tokens=self.num_speculative_tokens" in inspect.getsource(backend_xgrammar)
    assert {"speculative_config", "structured_outputs_config"} <= set(
        inspect.signature(_upstream_verify()).parameters
    )


def test_patch_is_installed():
    from vllm.sampling_params import SamplingParams

    patch.install()
    assert getattr(SamplingParams.verify, "_nemotron_spec_patch", False)


def _calls(backend: str | None, spec: bool, guided: bool, arch="DFlashNemotron35DraftModel"):
    """Call the patched verify with stub configs; returns (raised error or None, whether
    upstream's verify ran)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    ran = []

    def upstream(self, model_config, speculative_config, structured_outputs_config, tokenizer):
        ran.append(True)

    params = SamplingParams(
        max_tokens=4,
        structured_outputs=(StructuredOutputsParams(regex="[a-z]+") if guided else None),
    )
    verify = patch.make_verify(upstream)
    draft = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[arch]))
    spec_config = types.SimpleNamespace(method="dflash", draft_model_config=draft) if spec else None
    so_config = types.SimpleNamespace(backend=backend) if backend else None
    try:
        verify(params, None, spec_config, so_config, None)
    except Exception as exc:  # noqa: BLE001 - returned for the assertions
        return exc, bool(ran)
    return None, bool(ran)


def test_guided_request_on_lm_format_enforcer_with_drafts_is_refused():
    from vllm.exceptions import VLLMValidationError

    error, ran = _calls("lm-format-enforcer", spec=True, guided=True)
    assert isinstance(error, VLLMValidationError) and not ran
    message = str(error)
    assert "--structured-outputs-config.backend" in message and "lm-format-enforcer" in message
    assert "xgrammar" in message and "dflash" in message


@pytest.mark.parametrize(
    "backend,spec,guided",
    [
        ("lm-format-enforcer", False, True),  # no drafts
        ("lm-format-enforcer", True, False),  # no guide
        ("xgrammar", True, True),
        ("guidance", True, True),
        ("outlines", True, True),
        ("auto", True, True),
    ],
)
def test_everything_else_goes_to_upstream(backend, spec, guided):
    error, ran = _calls(backend, spec, guided)
    assert error is None and ran


def test_drafts_the_plugin_does_not_route_keep_vllms_behaviour():
    error, ran = _calls("lm-format-enforcer", spec=True, guided=True, arch="DFlashDraftModel")
    assert error is None and ran


def test_verify_of_another_signature_fails_the_install():
    def verify(self, model_config):
        pass

    with pytest.raises(TypeError, match="lacks the parameters"):
        patch.make_verify(verify)
