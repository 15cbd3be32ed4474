"""Input records -> buffer items (intake) and staged rows (at finalization). Anything that
cannot be decoded raises DecodeError and is dead-lettered with its original bytes."""

from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.decode.receipts import receipt_item
from stage.decode.route_chunks import route_chunk_item
from stage.decode.routing import MISROUTED, MisroutedError, check_routing
from stage.decode.staged import (
    DECODED_OVERHEAD_BYTES,
    release_routes,
    route_reference,
    staged_item,
    staged_route_fragment,
    staged_row,
)

__all__ = ["DECODED_OVERHEAD_BYTES", "DecodeError", "InputLimits", "MISROUTED", "MisroutedError", "check_routing", "receipt_item",
           "release_routes", "route_chunk_item", "route_reference", "staged_item", "staged_route_fragment", "staged_row"]
