"""Why an input record could not be used: it goes to the dead-letter topic with this text."""


class DecodeError(ValueError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
