"""Router-replay route plans and the shared route executor (NeMo RL spec §3, §5). No Kafka."""

from stage.routes import constants as _constants
from stage.routes.builder import RoutePlanBuildError, build_route_plan
from stage.routes.constants import *  # noqa: F403  (the constants are the public vocabulary)
from stage.routes.device import resolve_device
from stage.routes.executor import (
    ROUTED_EXPERTS_FALLBACK_DTYPE,
    RouteDimsCache,
    build_group_route_tensor,
    execute_direct_plan,
    execute_route_plan,
    group_route_rows,
    pad_route_rows,
)
from stage.routes.fragment import (
    RouteFragment,
    encode_extras_metadata_json,
    rebuild_route_extras,
    verify_route_fragment_integrity,
)
from stage.routes.plan import (
    RouteAssemblyPlan,
    RouteSpan,
    decode_route_plan,
    dumps_route_plan,
    encode_route_plan,
    encoded_route_plan_size_bytes,
    loads_route_plan,
    placeholder_route_plan,
    validate_route_plan,
)

__all__ = [
    *(name for name in vars(_constants) if name.isupper()),
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
    "verify_route_fragment_integrity",
]
