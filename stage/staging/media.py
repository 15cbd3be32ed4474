"""Per-call media (VLM capture) as staged: ``imgs`` ``[1, total_patches, 3*P*P]``
(float16/bfloat16/float32), ``imgs_sizes`` ``[N, 2]`` int32 (h, w) and optionally
``num_frames`` ``[N_videos]`` int32. numpy has no bfloat16: bfloat16 pixels are held as their
uint16 bit patterns with ``bfloat16=True`` (``StagedMedia.of`` builds that from a torch tensor)
and become ``torch.bfloat16`` again when tensorized (validation and concatenation:
stage.finalize.media).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class StagedMedia:
    imgs: np.ndarray                 # [1, total_patches, 3*P*P]
    imgs_sizes: np.ndarray           # [N, 2] int32
    num_frames: np.ndarray | None = None  # [N_videos] int32, videos only
    bfloat16: bool = False           # imgs holds bfloat16 bit patterns as uint16

    @classmethod
    def of(cls, imgs, imgs_sizes, num_frames=None) -> StagedMedia:
        """From numpy arrays or torch tensors (a torch.bfloat16 ``imgs`` keeps its dtype)."""
        bf16 = isinstance(imgs, torch.Tensor) and imgs.dtype == torch.bfloat16
        if bf16:
            imgs = imgs.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
        return cls(imgs=_numpy(imgs), imgs_sizes=_numpy(imgs_sizes),
                   num_frames=None if num_frames is None else _numpy(num_frames), bfloat16=bf16)

    @property
    def has_frames(self) -> bool:
        return self.num_frames is not None

    @property
    def pixel_dtype(self) -> str:
        """The pixels' wire dtype name."""
        return "bfloat16" if self.bfloat16 else str(self.imgs.dtype)

    def pixels(self) -> torch.Tensor:
        """``imgs`` as a private torch tensor in its real dtype (bfloat16 restored)."""
        t = torch.from_numpy(np.array(self.imgs, copy=True))
        return t.view(torch.bfloat16) if self.bfloat16 else t


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
