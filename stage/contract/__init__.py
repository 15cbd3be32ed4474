"""NeMo Gym 0.7.0 token-staging contract, re-implemented byte-compatibly (no Kafka imports).

Public names follow Gym's so its users recognise them.
"""

from .constants import *  # noqa: F401,F403  (versions, domains, reason codes)
from .constants import Code
from .digests import (
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from .errors import CaptureError, RebuildError, ReceiptVerificationError, StreamingUnsupportedError
from .fields import WireValidationError
from .linearized import ExtrasCommitment, LinearizedRow, WeightVersionSpan
from .records import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    default_staging_key,
)
from .routes import (
    RouteEnvelope,
    RoutedExpertsFragment,
    classify_route_span,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts_token_count,
)
from .terminal import TerminalSelection, select_terminal_call
from .verify import verify_and_linearize

staging_key = default_staging_key
