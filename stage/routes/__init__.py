"""Router-replay route plans and the shared route executor (NeMo RL spec §3, §5). No Kafka.

The constants are imported at once (torch-free); every other name from its module on first use
(stage.lazy_exports), so the settings model can read ROUTE_PLAN_SCHEMA_VERSION without torch.
"""

from stage import lazy_exports
from stage.routes import constants as _constants
from stage.routes.constants import *  # noqa: F403  (the constants are the public vocabulary)

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "builder": ("RoutePlanBuildError", "build_route_plan"),
    "device": ("resolve_device",),
    "dims": ("ConfiguredRouteDims", "GroupDims", "MAX_LEARNED_ROUTE_SLOTS", "RouteDimsCache"),
    "executor": ("ROUTED_EXPERTS_FALLBACK_DTYPE", "build_group_route_tensor",
                 "execute_direct_plan", "execute_route_plan", "group_route_rows", "pad_route_rows"),
    "fragment": ("RouteFragment", "encode_extras_metadata_json", "rebuild_route_extras",
                 "verify_route_fragment_integrity"),
    "plan": ("RouteAssemblyPlan", "RouteSpan", "decode_route_plan", "dumps_route_plan",
             "encode_route_plan", "encoded_route_plan_size_bytes", "loads_route_plan",
             "placeholder_route_plan", "validate_route_plan", "validated_route_plan_size_bytes"),
})

__all__ = [
    *(name for name in vars(_constants) if name.isupper()),
    "ConfiguredRouteDims",
    "GroupDims",
    "MAX_LEARNED_ROUTE_SLOTS",
    "ROUTED_EXPERTS_FALLBACK_DTYPE",
    "RouteAssemblyPlan",
    "RouteDimsCache",
    "RouteFragment",
    "RoutePlanBuildError",
    "RouteSpan",
    "build_group_route_tensor",
    "build_route_plan",
    "decode_route_plan",
    "dumps_route_plan",
    "encode_extras_metadata_json",
    "encode_route_plan",
    "encoded_route_plan_size_bytes",
    "execute_direct_plan",
    "execute_route_plan",
    "group_route_rows",
    "pad_route_rows",
    "loads_route_plan",
    "placeholder_route_plan",
    "rebuild_route_extras",
    "resolve_device",
    "validate_route_plan",
    "validated_route_plan_size_bytes",
    "verify_route_fragment_integrity",
]
