"""Schemathesis hooks of the contract test (`hooks` in tests/schemathesis.toml)."""

from __future__ import annotations

import schemathesis
from schemathesis import Case, Response
from schemathesis.core.failures import AcceptedNegativeData, Failure
from schemathesis.core.mutations import OperatorKind
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.meta import CoveragePhaseData, CoverageScenario
from schemathesis.hooks import HookContext
from schemathesis.openapi.checks import AuthScenario, IgnoredAuth


@schemathesis.hook
def filter_failure(context: HookContext, failure: Failure, case: Case, response: Response) -> bool:
    """Every failure but a 429 to an invalid key past the failed-authentication bound (documented on every /v1
    route: schemathesis takes only 401 or 403 for a refusal), and a multipart body "accepted" although the case changed the type of one of its fields: a
    form field is text or bytes on the wire whatever type the case gave it (`false` arrives as the bytes `false`,
    an empty array as no field at all), so what the API received was a valid request."""
    if isinstance(failure, IgnoredAuth):
        return not _refused_for_failed_authentications(failure)
    if not isinstance(failure, AcceptedNegativeData) or case.media_type != "multipart/form-data" or case.meta is None:
        return True
    data = case.meta.phase.data
    if isinstance(data, CoveragePhaseData) and data.scenario == CoverageScenario.INCORRECT_TYPE:
        return data.parameter_location != ParameterLocation.BODY
    return not data.mutations or not all(m.operator == OperatorKind.CHANGE_TYPE
                                         and m.parameter_location == ParameterLocation.BODY for m in data.mutations)


def _refused_for_failed_authentications(failure: IgnoredAuth) -> bool:
    """An invalid key answered 429: this address sent more unknown keys than CONVOQ_AUTH_FAILURES_BURST."""
    return failure.scenario == AuthScenario.INVALID_AUTH and "got `429 " in failure.message
