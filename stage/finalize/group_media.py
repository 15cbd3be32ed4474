"""Group-level media fields for VLM training (NeMo RL section 6, ``_media_fields_for_group``,
and the section 4.2 table).

NeMo RL publishes ``pixel_values``, ``imgs_sizes`` and ``num_frames`` as PackedTensors with one
logical row per sample: a valid row's chain media, an empty logical row for placeholders and
text-only rollouts, and no field at all when no valid row of the group carried media. Here a
row's media is a dict of torch tensors; an empty logical row is the same dict with zero entries
along the packed dimension 0 (the reference row's other dims and dtype), so it survives the
wire as a zero-length PackedTensor and tells a reader the group's media layout from any row.
"""

from __future__ import annotations

import numpy as np
import torch

from stage.finalize.media import StagedMedia, trainer_media

# The sorted union of the rows' keys, as NeMo RL iterates them.
MEDIA_FIELDS = ("imgs_sizes", "num_frames", "pixel_values")
# pad_group companion of each field: int64 [n], the entries row i contributes along dim 0.
ROW_COUNTS_SUFFIX = "__row_counts"


def row_counts_key(name: str) -> str:
    return name + ROW_COUNTS_SUFFIX


def media_tensors(media: StagedMedia, device) -> dict[str, torch.Tensor]:
    """One logical row of trainer media (``trainer_media``) as torch tensors on ``device``."""
    # A private copy: staged arrays may be read-only views of the decoded record's bytes.
    # Pixels come through StagedMedia.pixels(), which restores bfloat16 from its bit patterns.
    return {name: (media.pixels()[0] if name == "pixel_values"
                   else torch.from_numpy(np.array(array, copy=True))).to(device)
            for name, array in trainer_media(media).items()}


def empty_like_row(reference: torch.Tensor) -> torch.Tensor:
    """``PackedTensor.empty_rows_like(reference, 1)``: no entries, the reference's layout."""
    return reference.new_empty((0, *reference.shape[1:]))


def group_media_rows(rows_media: list[dict | None]) -> list[dict] | None:
    """Each row's media fields, an empty logical row where a row has none; None when no row
    has media (a text-only group publishes no media fields). ``rows_media[i]`` is row i's
    media, given only for valid rows that carried media."""
    names = sorted({name for media in rows_media if media is not None for name in media})
    if not names:
        return None
    references = {name: next(m[name] for m in rows_media if m is not None and name in m)
                  for name in names}
    out = []
    for media in rows_media:
        row = {}
        for name in names:
            value = None if media is None else media.get(name)
            row[name] = value if value is not None else empty_like_row(references[name])
        out.append(row)
    return out


def pad_group_media(rows_media: list[dict | None], device) -> dict[str, torch.Tensor]:
    """The group's media as the trainer takes it: per field, the rows concatenated along dim 0
    in row order (NeMo RL's ``PackedTensor.as_tensor``), plus ``<field>__row_counts`` int64
    ``[n]`` so row i is ``torch.split(field, counts.tolist())[i]``. A row without the field
    (a reader given rows of an older stage) counts as an empty logical row. {} when no row has
    media. Raises ValueError when rows disagree beyond dim 0 (they cannot be concatenated)."""
    rows = group_media_rows(rows_media)
    if rows is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name in rows[0]:
        parts = [row[name] for row in rows]
        layout = tuple(parts[0].shape[1:])
        for i, part in enumerate(parts):
            if part.dim() == 0 or tuple(part.shape[1:]) != layout:
                expected = "[*" + "".join(f", {d}" for d in layout) + "]"
                raise ValueError(f"media field {name}: row {i} has shape {list(part.shape)}, "
                                 f"the group's rows are {expected}")
        # torch.cat promotes mixed dtypes as NeMo RL's as_tensor does.
        out[name] = torch.cat([part.to(device) for part in parts], dim=0)
        out[row_counts_key(name)] = torch.tensor([int(p.shape[0]) for p in parts],
                                                 dtype=torch.int64, device=device)
    return out
