"""Versions, hash domains and reason codes of NeMo Gym 0.7.0's staging contract.

Every value here is part of the wire contract: never change or repurpose one.
"""

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

# Domain tags are prepended raw (no length prefix) to each SHA-256 input.
CALL_DIGEST_DOMAIN = b"nemo-gym-staging-call-v2"
EXTRAS_DIGEST_DOMAIN = b"nemo-gym-staging-extras-v1"
PREFIX_HASH_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_HASH_DOMAIN = b"nemo-gym-staging-chain-v1"

EMPTY_EXTRAS_DIGEST = "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"

ROUTED_EXPERTS_ENVELOPE_VERSION = 1
ROUTED_EXPERTS_MAGIC = "nrlre1"
MISSING_ROUTE_SENTINEL = -1
ROUTE_DTYPES = ("int8", "int16", "int32")

FINGERPRINT_VERSION = 2
NG_CAPTURE_FIELD = "ng_capture"
NG_COMMIT_COORDS_FIELD = "ng_commit_coords"

CAPTURE_MODES = ("token_in", "text")
CAPTURE_DISPOSITIONS = ("staged", "capture_failed")
TERMINAL_SELECTIONS = ("declared", "response_id", "content", "heuristic")

# Poison / failure reasons (RolloutReceipt.failure_reason, ManifestFailure.reason).
UNRESOLVED_PARENT_REASON = "unresolved_parent"
UNCOMMITTED_CALL_REASON = "request_finished_without_staged_coordinates"
LEDGER_ROW_MISSING_RESPONSE_ID_REASON = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH_REASON = "ledger_row_missing_chain_hash"
WORKER_MISSING_COMMIT_COORDS_REASON = "worker_response_missing_commit_coordinates"
WORKER_CAPTURE_FAILED_REASON = "worker_capture_failed"
INVALID_COMMIT_COORDS_REASON = "invalid_worker_commit_coordinates"

# select_terminal_call reasons.
TERMINAL_SELECTED = "selected"
TERMINAL_NO_RECORDS = "no_records"
TERMINAL_DUPLICATE_CALL_ID = "duplicate_call_id"
TERMINAL_ORPHANED_ROW = "orphaned_row"
TERMINAL_NO_ROOT = "no_root"
TERMINAL_AMBIGUOUS = "ambiguous_terminal"


class Code:
    """ReceiptVerificationError / RebuildError codes (Gym section 4.4)."""

    # receipt gate
    UNSUPPORTED_SCHEMA = "unsupported_schema"
    UNSUPPORTED_DIGEST = "unsupported_digest"
    UNSUPPORTED_EXTRAS_DIGEST = "unsupported_extras_digest"
    ROLLOUT_FAILED = "rollout_failed"
    CAPTURE_POISONED = "capture_poisoned"
    EMPTY_MANIFEST = "empty_manifest"
    # manifest and row binding
    DUPLICATE_MANIFEST_ROW = "duplicate_manifest_row"
    DUPLICATE_STAGING_KEY = "duplicate_staging_key"
    ROW_COUNT_MISMATCH = "row_count_mismatch"
    DUPLICATE_SNAPSHOT = "duplicate_snapshot"
    SNAPSHOT_IDENTITY_MISMATCH = "snapshot_identity_mismatch"
    SNAPSHOT_ORDER_MISMATCH = "snapshot_order_mismatch"
    WRONG_ROLLOUT = "wrong_rollout"
    # digest recomputation (field comparisons are f"wrong_{field}")
    INVALID_SNAPSHOT = "invalid_snapshot"
    CORRUPT_DIGEST = "corrupt_digest"
    # RebuildError
    MISSING_PARENT = "missing_parent"
    PARENT_LENGTH_MISMATCH = "parent_length_mismatch"
    LINEAGE_CYCLE = "lineage_cycle"
    MISSING_TERMINAL = "missing_terminal"
    CHAIN_HASH_MISMATCH = "chain_hash_mismatch"
    INVALID_MASK_ORDER = "invalid_mask_order"
    EMPTY_GENERATION = "empty_generation"
    EMPTY_TRAINING_ROW = "empty_training_row"
    CUMULATIVE_HASH_MISMATCH = "cumulative_hash_mismatch"


# Snapshot-vs-manifest fields compared by the verifier, in Gym's order.
COMPARED_FIELDS = (
    "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len", "cum_len",
    "weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash",
)
VERSION_FIELDS = ("schema_version", "digest_version", "extras_digest_version")
