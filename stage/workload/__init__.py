"""Seeded synthetic agentic rollouts with configurable fault injection (pure, no Kafka)."""

from stage.workload.faults import (
    DEADLINE_FAULTS,
    GARBAGE,
    LATE_RECEIPT,
    MISSING_RECEIPT,
    MISSING_STAGED,
    POISONED_RECEIPT,
    ROLLOUT_FAULTS,
    TAMPERED_DIGEST,
    TAMPERED_TOKENS,
    ExpectedRejection,
    FaultRates,
)
from stage.workload.generator import (
    CallSpec,
    Garbage,
    GroupSpec,
    RolloutSpec,
    Workload,
    WorkloadConfig,
    generate,
    generate_group,
)
from stage.workload.profiles import AGENTIC_MOE, FRONTIER, PROFILE_NAMES, PROFILES, TOY, describe, profile

__all__ = [
    "AGENTIC_MOE", "FRONTIER", "PROFILES", "PROFILE_NAMES", "TOY", "describe", "profile",
    "CallSpec", "DEADLINE_FAULTS", "ExpectedRejection", "FaultRates", "GARBAGE", "Garbage",
    "GroupSpec", "LATE_RECEIPT", "MISSING_RECEIPT", "MISSING_STAGED", "POISONED_RECEIPT",
    "ROLLOUT_FAULTS", "RolloutSpec", "TAMPERED_DIGEST", "TAMPERED_TOKENS", "Workload",
    "WorkloadConfig", "generate", "generate_group",
]
