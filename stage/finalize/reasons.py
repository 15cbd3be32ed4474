"""Rejection reasons of rollout finalization (NeMo RL's vocabulary, exact strings).

A reason is either a constant or ``<prefix>:<detail>``; the metrics bucket is the text before
the first colon (``bucket_of``).
"""

from __future__ import annotations

MISSING_RECEIPT = "missing_receipt"
INVALID_RECEIPT = "invalid_receipt"                  # :<error>
IDENTITY_MISMATCH = "identity_mismatch"              # :<receipt rollout_id>
ROLLOUT_FAILED = "rollout_failed"                    # :<failure_reason>
CAPTURE_POISONED = "capture_poisoned"
DUPLICATE_STAGING_KEY = "duplicate_staging_key"
DUPLICATE_MANIFEST_CALL_ID = "duplicate_manifest_call_id"
MISSING_STAGING_ROW = "missing_staging_row"          # :<KeyError text, quoted>
INVALID_STAGING_ROW = "invalid_staging_row"          # :<error>
STAGING_KEY_MISMATCH = "staging_key_mismatch"        # :<model_call_id>
CALL_ID_MISMATCH = "call_id_mismatch"                # :<model_call_id>
DUPLICATE_FETCHED_CALL_ID = "duplicate_fetched_call_id"
REBUILD_FAILED = "rebuild_failed"                    # :<code>: <detail>
MEDIA_CHAIN_IDENTITY = "media_chain_identity"        # :<model_call_id>
MEDIA_CHAIN_INCOMPATIBLE = "media_chain_incompatible"  # :<error>
MEDIA_MIXED_KINDS = "mixed image and video calls"
INVALID_MEDIA_COLUMNS = "invalid_media_columns"      # :<error>
TOPK_LENGTH_MISMATCH = "topk_length_mismatch"        # :<model_call_id>
# Route-plan reasons live with the route code; re-exported so one module names them all.
from stage.routes.constants import (  # noqa: E402
    REJECT_DUPLICATE_ROUTE_SPAN as DUPLICATE_ROUTE_SPAN,
    REJECT_INVALID_ROUTE_PLAN as INVALID_ROUTE_PLAN,
    REJECT_ROUTE_ASSEMBLY as ROUTE_ASSEMBLY,
    REJECT_ROUTE_BOUNDARY_INDEX_MISMATCH as ROUTE_BOUNDARY_INDEX_MISMATCH,
    REJECT_ROUTE_CARRY_SPAN_MISMATCH as ROUTE_CARRY_SPAN_MISMATCH,
    REJECT_ROUTE_GENERATION_SPAN_MISMATCH as ROUTE_GENERATION_SPAN_MISMATCH,
    REJECT_ROUTE_SPAN_IDENTITY as ROUTE_SPAN_IDENTITY,
    REJECT_ROUTE_SPAN_LENGTH_MISMATCH as ROUTE_SPAN_LENGTH_MISMATCH,
    REJECT_ROUTED_LEN_MISMATCH as ROUTED_LEN_MISMATCH,
)
# Not NeMo RL's: a verified token id that int64 training tensors cannot hold.
TOKEN_ID_RANGE = "token id exceeds int64 range"
# Not NeMo RL's (it raises RuntimeError, and the stage would halt): direct router replay, a
# valid row without routes while (L, K) is neither configured (finalize.route_layers /
# route_topk) nor learned yet, so its sentinel route tensor cannot be shaped.
ROUTE_DIMS_UNKNOWN = "route_dims_unknown"
# Not NeMo RL's: a float the row would publish is NaN or infinite (or beyond float32, the
# published width). Detail: the published column (generation_topk_logprobs, pixel_values,
# total_reward, sample_mask). Token log-probs and masks never get here: the contract refuses
# non-finite values when it builds the staged snapshot.
NON_FINITE_VALUE = "non_finite_value"

# Not NeMo RL's: the stage's liveness reasons (stage.finalize.failures says why none halts).
# A rollout's finalization raised what no guard names (an input the guards did not foresee):
FINALIZE_ERROR = "finalize_error"                    # :<exception type>: <message>
# The group's own step raised (tensorization, group routes or media): every row rejected.
GROUP_FINALIZE_ERROR = "group_finalize_error"        # :<exception type>: <message>
# A record of the row cannot be encoded: its RoutePlan over the output codec's
# max_record_bytes, or a CanonicalRow too large even split into parts (docs/schemas.md).
UNPUBLISHABLE_RECORD = "unpublishable_record"        # :<record>: <why>

UNKNOWN_BUCKET = "unknown"
# A reason is published in its row and in the group summary, N times: its detail (input text,
# such as a receipt's failure_reason, or an error message quoting it) is cut to this length.
MAX_REASON_CHARS = 1024


def reason(prefix: str, detail) -> str:
    return f"{prefix}:{detail}"


def bounded(text: str) -> str:
    """``text`` cut to MAX_REASON_CHARS, saying how much was cut."""
    if len(text) <= MAX_REASON_CHARS:
        return text
    return f"{text[:MAX_REASON_CHARS - 32]}...(+{len(text) - MAX_REASON_CHARS + 32} chars)"


def bucket_of(rejection_reason: str | None) -> str:
    """Metrics bucket of a rejection: the text before the first colon."""
    if rejection_reason is None:
        return UNKNOWN_BUCKET
    return rejection_reason.split(":", 1)[0]
