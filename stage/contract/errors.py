"""Error classes of the staging contract (Gym section 2.11)."""


class ReceiptVerificationError(ValueError):
    """A receipt does not verify against its staged rows. ``str(e) == f"{code}: {detail}"``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class RebuildError(ReceiptVerificationError):
    """Lineage graph, chain or linearization failure."""


class CaptureError(Exception):
    """A caller broke the producer-side capture lifecycle."""


class StreamingUnsupportedError(CaptureError):
    pass
