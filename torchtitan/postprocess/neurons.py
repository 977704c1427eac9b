"""Instances from predicted boundaries: neurons (``cell``) cut apart by their membranes (``pm``).

In dense neuropil nearly every voxel belongs to some neuron, so the mask of ``cell`` is one
object and its connected components say nothing. What separates neurons is the membrane
between them, which a model predicts as its own class. The usual answer of connectomics is a
seeded watershed of the boundary prediction (distance-transform watershed):

1. **Interior**: the voxels not predicted as boundary (inside the class's own mask, when the
   class is predicted too).
2. **Distance** of every interior voxel to the nearest predicted boundary, in nm
   (``scipy.ndimage.distance_transform_edt`` with the voxel size), so settings hold at any
   voxel size and anisotropy.
3. **Seeds**: the face-connected parts of the interior farther than ``seed_nm`` from a
   boundary, so that a small gap in a predicted membrane (narrower than twice ``seed_nm``)
   does not join two neurons there; a seed smaller than ``min_object_nm3`` is dropped (the
   specks of interior between noisy boundaries would each become a fragment).
4. **Flooding**: ``skimage.segmentation.watershed`` grows the seeds down the distance map
   (from the middle of each neuron outwards), over the boundary voxels too, so every voxel of
   the class's mask gets an id and neighbours meet in the middle of their membrane.

Floor 3: numpy, scipy and scikit-image; asks nothing of ours but the evaluation's relabelling.
"""

from __future__ import annotations

import numpy as np
import scipy.ndimage as ndi

from torchtitan.scoring.metrics import label_instances


def boundary_instances(boundary, voxel_size, seed_nm: float, inside=None,
                       min_object_nm3: float = 0.0) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n) of the objects that the
    predicted ``boundary`` mask cuts apart (module docstring).

    ``inside``: the mask of the class itself (None: every voxel); voxels outside it get 0.
    ``seed_nm``: how far from a boundary a seed starts (nm); ``min_object_nm3``: the smallest
    seed kept (nm^3).
    """
    from skimage.segmentation import watershed

    boundary = np.asarray(boundary, dtype=bool)
    inside = np.ones(boundary.shape, bool) if inside is None else np.asarray(inside, dtype=bool)
    if inside.shape != boundary.shape:
        raise ValueError(f"boundary {boundary.shape} and mask {inside.shape} differ in shape")
    sampling = np.asarray(voxel_size, dtype=float)
    interior = inside & ~boundary
    if not interior.any():
        return np.zeros(boundary.shape, np.int32), 0
    distance = ndi.distance_transform_edt(interior, sampling=sampling)
    seeds, n = ndi.label(interior & (distance > seed_nm))
    min_voxels = int(np.ceil(min_object_nm3 / float(np.prod(sampling))))
    if n and min_voxels > 1:
        sizes = np.bincount(seeds.ravel(), minlength=n + 1)
        seeds[sizes[seeds] < min_voxels] = 0
    if not seeds.any():  # no interior deep enough anywhere: the mask is one object
        return label_instances(inside)
    ids = watershed(-distance, markers=seeds, mask=inside)
    return label_instances(ids)
