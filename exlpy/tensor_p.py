"""exllamav2's `tensor_p` module: the broadcast-type constants and `TPContext`."""

from exlpy.parallel.tp_context import TPContext
from exlpy.parallel.tp_split import (
    BROADCAST_ID,
    BROADCAST_KV,
    BROADCAST_Q,
    BROADCAST_RS,
    BROADCAST_VC,
    integer_split,
)

__all__ = ["BROADCAST_ID", "BROADCAST_KV", "BROADCAST_Q", "BROADCAST_RS", "BROADCAST_VC", "TPContext",
           "integer_split"]
