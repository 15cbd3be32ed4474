"""Per-call media (VLM capture): validation and concatenation along the terminal chain.

NeMo RL section 6. A staged call carries only media new to that call: ``imgs``
``[1, total_patches, 3*P*P]`` (float16/bfloat16/float32), ``imgs_sizes`` ``[N, 2]`` int32 (h, w)
and optionally ``num_frames`` ``[N_videos]`` int32. Arrays are numpy here; tensorization moves
them to torch. numpy has no bfloat16: bfloat16 pixels are held as their uint16 bit patterns
with ``bfloat16=True`` (``StagedMedia.of`` builds that from a torch tensor) and become
``torch.bfloat16`` again when tensorized.
"""

from __future__ import annotations

import numpy as np
import torch

from stage.staging.media import StagedMedia

_PIXEL_DTYPES = ("float16", "float32", "bfloat16")
_I32_MAX = np.iinfo(np.int32).max


def validate_media(media: StagedMedia, patch_size: int) -> None:
    """Raise ValueError unless the columns describe a consistent set of square RGB patches."""
    imgs, sizes = media.imgs, media.imgs_sizes
    if imgs.ndim != 3 or imgs.shape[0] != 1 or imgs.shape[1] <= 0:
        raise ValueError(f"media imgs must be [1, total_patches>0, 3*P*P], got {tuple(imgs.shape)}")
    if imgs.shape[2] != 3 * patch_size * patch_size:
        raise ValueError(f"media patches must be square RGB {patch_size}x{patch_size}, "
                         f"got feature width {imgs.shape[2]}")
    if media.bfloat16 and imgs.dtype != np.uint16:
        raise ValueError(f"media bfloat16 pixels must be held as uint16 bit patterns, got {imgs.dtype}")
    if media.pixel_dtype not in _PIXEL_DTYPES:
        raise ValueError(f"media pixel dtype must be one of {_PIXEL_DTYPES}, got {media.pixel_dtype}")
    if sizes.ndim != 2 or sizes.shape[1] != 2 or sizes.shape[0] == 0 or sizes.dtype.kind not in "iu":
        raise ValueError(f"media imgs_sizes must be [N>0, 2] integers, got {tuple(sizes.shape)}")
    if (sizes <= 0).any() or (sizes > _I32_MAX).any():
        raise ValueError("media imgs_sizes must be positive int32 values")
    if (sizes % patch_size).any():
        raise ValueError(f"media imgs_sizes must be divisible by the patch size {patch_size}")
    patches = int((sizes[:, 0].astype(np.int64) * sizes[:, 1]).sum()) // (patch_size * patch_size)
    if patches != imgs.shape[1]:
        raise ValueError(f"media imgs_sizes cover {patches} patches, imgs has {imgs.shape[1]}")
    if media.num_frames is not None:
        frames = media.num_frames
        if frames.ndim != 1 or frames.size == 0 or (frames <= 0).any():
            raise ValueError("media num_frames must be a non-empty 1-D array of positive counts")
        if int(frames.sum()) != sizes.shape[0]:
            raise ValueError(f"media num_frames sum to {int(frames.sum())}, expected {sizes.shape[0]}")


_BF16_EXPONENT = 0x7F80   # all ones: inf or NaN


def pixels_finite(media: StagedMedia) -> bool:
    """No NaN or infinite pixel (bfloat16 checked on its bit patterns)."""
    if media.bfloat16:
        return not ((media.imgs & _BF16_EXPONENT) == _BF16_EXPONENT).any()
    return bool(np.isfinite(media.imgs).all())


def concat_media(parts: list[StagedMedia]) -> StagedMedia:
    """Concatenate the chain's media in chain order (NeMo RL ``_concat_media``)."""
    if not parts:
        raise ValueError("media chain is empty")
    if len(parts) == 1:
        return parts[0]
    dtypes = {p.pixel_dtype for p in parts}
    if len(dtypes) > 1:
        raise ValueError(f"media chain mixes pixel dtypes {sorted(dtypes)}")
    widths = {int(p.imgs.shape[2]) for p in parts}
    if len(widths) > 1:
        raise ValueError(f"media chain mixes patch feature widths {sorted(widths)}")
    with_frames = [p.num_frames is not None for p in parts]
    if any(with_frames) and not all(with_frames):
        raise ValueError("media chain mixes calls with and without frame counts")
    frames = np.concatenate([p.num_frames for p in parts]) if all(with_frames) else None
    return StagedMedia(
        imgs=np.concatenate([p.imgs for p in parts], axis=1),
        imgs_sizes=np.concatenate([p.imgs_sizes for p in parts], axis=0),
        num_frames=frames, bfloat16=parts[0].bfloat16)


def trainer_media(media: StagedMedia) -> dict[str, np.ndarray]:
    """One logical row of trainer media: pixel_values (leading 1 squeezed; bfloat16 as its
    uint16 bits, see ``media.bfloat16``), imgs_sizes, num_frames (given, else one frame per
    still)."""
    frames = media.num_frames if media.num_frames is not None else np.ones(
        media.imgs_sizes.shape[0], dtype=np.int32)
    return {"pixel_values": media.imgs[0], "imgs_sizes": media.imgs_sizes.astype(np.int32),
            "num_frames": frames.astype(np.int32)}
