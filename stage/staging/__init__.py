"""What the decoder produces and finalization reads: a staged call as the stage stores it
(``StagedRow``, with its ``TopK`` and ``StagedMedia``), and the value checks both apply. Below
decode and finalize, so the data's path and the imports run the same way."""

from stage.staging.media import StagedMedia
from stage.staging.rows import StagedRow, TopK, staged_row_from_record
from stage.staging.values import fits_float32

__all__ = ["StagedMedia", "StagedRow", "TopK", "fits_float32", "staged_row_from_record"]
