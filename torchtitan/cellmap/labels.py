"""What a stored label value means: absent, present, unknown, or an instance id.

Every label group of a CellMap crop stores one class, as 0/1/255 values or, for instance
classes, as one id per object (1, 2, 3, ...). The group's ``cellmap`` attribute names the
values (``cellmap.annotation.annotation_type.encoding``, by default ``absent`` 0,
``present`` 1, ``unknown`` 255); the challenge's instance crops store object ids instead of
``present``.

The rule, in one place (:func:`label_to_target`), for training targets, validation truth,
scoring truth and plots alike:

* a voxel is *valid* (annotated) unless it holds the ``unknown`` value;
* a valid voxel is *present* unless it holds the ``absent`` value. So every instance id
  counts as present, not only the value ``present`` (a rule ``raw == present`` would drop
  every object but the one with id 1).

Voxels outside a crop are read as ``unknown`` by the readers, so they are invalid too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ABSENT, PRESENT, UNKNOWN = 0, 1, 255  # the CellMap challenge's default values
# The annotation types of a label group (``cellmap.annotation.annotation_type.type``).
SEMANTIC_TYPE, INSTANCE_TYPE = "semantic_segmentation", "instance_segmentation"


@dataclass(frozen=True)
class LabelEncoding:
    """The values one label group uses for absent, present and unknown voxels."""

    absent: int = ABSENT
    present: int = PRESENT  # what a semantic group writes; any non-absent value reads present
    unknown: int = UNKNOWN

    @classmethod
    def from_attrs(cls, attrs: dict) -> LabelEncoding:
        """The encoding a label group's attributes declare (defaults for what they omit)."""
        enc = attrs.get("cellmap", {}).get("annotation", {}).get("annotation_type", {}).get(
            "encoding", {})
        return cls(int(enc.get("absent", ABSENT)), int(enc.get("present", PRESENT)),
                   int(enc.get("unknown", UNKNOWN)))

    @staticmethod
    def declares_ids(attrs: dict) -> bool:
        """Whether a label group's attributes declare object ids (annotation type
        ``instance_segmentation``, as :func:`annotation_attrs` writes it)."""
        kind = attrs.get("cellmap", {}).get("annotation", {}).get("annotation_type", {}).get("type")
        return kind == INSTANCE_TYPE

    def as_dict(self) -> dict[str, int]:
        return {"absent": self.absent, "present": self.present, "unknown": self.unknown}


DEFAULT_ENCODING = LabelEncoding()


def label_to_target(raw: np.ndarray, encoding: LabelEncoding = DEFAULT_ENCODING,
                    out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Boolean (target, valid) of stored label values (see the module docstring).

    ``out``: boolean arrays of ``raw``'s shape to write into (the training loader composes
    many targets into one preallocated buffer).
    """
    target, valid = out if out is not None else (np.empty(raw.shape, bool), np.empty(raw.shape, bool))
    np.not_equal(raw, encoding.unknown, out=valid)
    np.not_equal(raw, encoding.absent, out=target)
    target &= valid
    return target, valid


def label_to_ids(raw: np.ndarray, encoding: LabelEncoding = DEFAULT_ENCODING) -> np.ndarray:
    """Object ids (int64) of stored label values: 0 where absent or unknown, else the value.

    A semantic group gives 0/1 here, which instance evaluation splits into connected
    components; an instance group gives its ids.
    """
    target, _ = label_to_target(raw, encoding)
    return np.where(target, raw, 0).astype(np.int64)


def holds_instance_ids(raw: np.ndarray, encoding: LabelEncoding = DEFAULT_ENCODING) -> bool:
    """Whether stored values hold object ids: some present voxel has a value other than
    ``present`` (a semantic 0/1/255 group holds none)."""
    target, _ = label_to_target(raw, encoding)
    return bool(np.any(raw[target] != encoding.present))


def annotation_attrs(class_name: str, s0: np.ndarray,
                     encoding: LabelEncoding = DEFAULT_ENCODING, instances: bool = False) -> dict:
    """The ``cellmap`` attribute of a label group, as the challenge writes it: semantic (0/1
    values), or ``instances`` (object ids); the complement counts are taken from level
    ``s0``."""
    kind = INSTANCE_TYPE if instances else SEMANTIC_TYPE
    return {
        "cellmap": {
            "annotation": {
                "annotation_type": {"encoding": encoding.as_dict(), "type": kind},
                "class_name": class_name,
                "complement_counts": {
                    "absent": int(np.count_nonzero(s0 == encoding.absent)),
                    "unknown": int(np.count_nonzero(s0 == encoding.unknown)),
                },
            }
        }
    }
