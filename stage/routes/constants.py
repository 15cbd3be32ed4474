"""Route-plan and route-executor constants (nemo-rl-reassembler spec §3.1, §3.6, §3.9, §5).

Every string here is a wire/metric contract: plans are published to other processes and
failure reasons become metric names, so values must match the spec byte-for-byte.
"""

from __future__ import annotations

# --- plan schema ----------------------------------------------------------------------
ROUTE_PLAN_SCHEMA_VERSION = 3
# v2 plans (no boundary fields) are still decoded and executed.
LEGACY_ROUTE_PLAN_SCHEMA_VERSION = 2
SUPPORTED_ROUTE_PLAN_SCHEMA_VERSIONS = (LEGACY_ROUTE_PLAN_SCHEMA_VERSION, ROUTE_PLAN_SCHEMA_VERSION)

# Only extras-digest version 1 exists in the Gym contract.
ROUTE_EXTRAS_DIGEST_VERSION = 1
SHA256_HEX_LENGTH = 64

# --- sentinel / dtype -----------------------------------------------------------------
ROUTE_MISSING_SENTINEL = -1  # == Gym MISSING_ROUTE_SENTINEL
ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL = ROUTE_MISSING_SENTINEL
# Executor output dtype whatever the staged dtype (kept as a name so this module stays torch-free).
ROUTED_EXPERTS_OUTPUT_DTYPE_NAME = "int16"

# --- staged column / extras key names -------------------------------------------------
ROUTED_EXPERTS_FIELD = "routed_experts"
ROUTED_LEN_FIELD = "routed_len"
ROUTED_EXPERTS_ENCODING_FIELD = "routed_experts_encoding"
ROUTED_EXTRAS_METADATA_FIELD = "extras_metadata_json"
ROUTED_EXPERTS_BOUNDARY_FIELD = "routed_experts_boundary"
ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD = "routed_experts_boundary_index"
ROUTED_EXPERTS_BOUNDARY_SCHEMA_VERSION = 1
ROUTE_PLAN_TAG = "route_assembly_plan"
ROUTE_PASSTHROUGH_FLAG = "route_passthrough"

# --- staging wire codes for routed_experts_encoding ------------------------------------
ROUTE_ENCODING_NONE = 0  # call staged no routes
ROUTE_ENCODING_ENVELOPE = 1  # extras carried an nrlre1 envelope; tensor keeps the envelope dtype
ROUTE_ENCODING_LIST = 2  # extras carried nested lists; staged as int16, digest over tolist()

# --- classify_route_span modes (Gym decision table) -------------------------------------
ROUTE_SPAN_FULL = "full"
ROUTE_SPAN_TAIL = "tail"
ROUTE_SPAN_SENTINEL = "sentinel"

# --- executor failure vocabulary (§3.6) ------------------------------------------------
ROUTE_FAILURE_CANONICAL_LENGTH = "canonical_length_mismatch"
ROUTE_FAILURE_MISSING_FRAGMENT = "missing_fragment"
ROUTE_FAILURE_INTEGRITY = "fragment_integrity"
ROUTE_FAILURE_RANK = "fragment_rank"
ROUTE_FAILURE_LENGTH = "fragment_length"
ROUTE_FAILURE_MODEL_SHAPE = "fragment_model_shape"
ROUTE_FAILURE_ASSEMBLED_LENGTH = "assembled_length_mismatch"
ROUTE_FAILURE_BOUNDARY = "fragment_boundary"
# Not NeMo RL's: a fragment of learned dims (none configured) with more L * K slots a token
# than the stage learns (stage.routes.dims): rejected before anything of that shape is built.
ROUTE_FAILURE_DIMS_LIMIT = "fragment_dims_limit"
ROUTE_FAILURE_REASONS = (
    ROUTE_FAILURE_CANONICAL_LENGTH,
    ROUTE_FAILURE_MISSING_FRAGMENT,
    ROUTE_FAILURE_INTEGRITY,
    ROUTE_FAILURE_RANK,
    ROUTE_FAILURE_LENGTH,
    ROUTE_FAILURE_MODEL_SHAPE,
    ROUTE_FAILURE_ASSEMBLED_LENGTH,
    ROUTE_FAILURE_BOUNDARY,
)

# Not NeMo RL's: routes staged by reference (stage.staging.route_refs) fail in the trainer's
# fetcher before the executor runs, one reason a row: a chunk the reference names is not there
# (deleted, expired, beyond the log's end, not fetched in time), is another call's or another
# length (mismatch), or its bytes are not the ones committed to (corrupt: its SHA-256, found
# when the extras digest over the joined payload fails); or the reference itself is unusable.
ROUTE_FAILURE_CHUNK_MISSING = "chunk_missing"
ROUTE_FAILURE_CHUNK_MISMATCH = "chunk_mismatch"
ROUTE_FAILURE_CHUNK_CORRUPT = "chunk_corrupt"
ROUTE_FAILURE_INVALID_REFERENCE = "invalid_reference"
ROUTE_CHUNK_FAILURE_REASONS = (
    ROUTE_FAILURE_CHUNK_MISSING,
    ROUTE_FAILURE_CHUNK_MISMATCH,
    ROUTE_FAILURE_CHUNK_CORRUPT,
    ROUTE_FAILURE_INVALID_REFERENCE,
)

# --- finalizer rejection prefixes for plan construction (§2 guards 15-22) --------------
REJECT_DUPLICATE_ROUTE_SPAN = "duplicate_route_span"
REJECT_ROUTE_SPAN_IDENTITY = "route_span_identity"
REJECT_ROUTED_LEN_MISMATCH = "routed_len_mismatch"
REJECT_ROUTE_GENERATION_SPAN_MISMATCH = "route_generation_span_mismatch"
REJECT_ROUTE_CARRY_SPAN_MISMATCH = "route_carry_span_mismatch"
REJECT_ROUTE_BOUNDARY_INDEX_MISMATCH = "route_boundary_index_mismatch"
REJECT_ROUTE_SPAN_LENGTH_MISMATCH = "route_span_length_mismatch"
REJECT_INVALID_ROUTE_PLAN = "invalid_route_plan"
REJECT_ROUTE_ASSEMBLY = "route_assembly"

# --- encoded plan layout (§3.5): key order is part of the byte-identical-plan contract ---
ROUTE_PLAN_FIELDS = (
    "schema_version",
    "staging_partition",
    "spans",
    "cleanup_staging_keys",
    "expected_token_length",
)
ROUTE_SPAN_FIELDS_V2 = (
    "staging_key",
    "carry_len",
    "generation_len",
    "staged_route_len",
    "extras_digest_version",
    "extras_digest",
)
ROUTE_SPAN_FIELDS_V3 = ROUTE_SPAN_FIELDS_V2 + ("boundary_token_index", "repair_previous_token")

# --- log / error messages ----------------------------------------------------------------
LEGACY_BOUNDARY_WARNING = (
    "Legacy captured call %s has no boundary route; retaining the previous token's route. "
    "Fresh capture is required for turn-boundary replay parity."
)
UNKNOWN_ROUTE_DIMS_MESSAGE = (
    "policy.router_replay.enabled=true (token-capture mode) but no finalized rollout has "
    "carried routed_experts yet, so the placeholder group tensor cannot be shaped. Check vLLM "
    "enable_return_routed_experts and the staging-extras path."
)

# --- group-tensor metrics (§3.9) -------------------------------------------------------
METRIC_ROUTED_EXPERTS_ROW_COVERAGE = "finalize/routed_experts_row_coverage"
METRIC_ROUTED_EXPERTS_SENTINEL_TOKEN_FRACTION = "finalize/routed_experts_sentinel_token_fraction"
