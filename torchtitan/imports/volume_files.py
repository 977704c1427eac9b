"""3D volumes held in HDF5 files (``FILE.h5:volumes/raw``), read the way image stacks are.

Connectomics data usually comes as HDF5 (CREMI, neuroproof, ilastik exports): one file holding
the EM and a volume of object ids as (z, y, x) datasets, often with a ``resolution`` attribute
(z, y, x in nm, CREMI's convention). :class:`HDF5Volume` offers what
:class:`~torchtitan.imports.image_stack.ImageStack` offers (``len`` sections, the ``shape`` of
one, ``dtype``, ``read``, ``read_range``, and ``name`` / ``where`` for messages), so the import
writes EM and labels from either the same way; :func:`resolve_voxel_size` takes the voxel
size from the attribute where no ``--voxel_size`` is given. It reads slabs of sections
(:func:`slabs`), never a whole volume, and opens the file per read, so nothing stays open
between the checks and the writing.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.imports.stack_labels import ImageStackError

HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")
_SPEC = re.compile(r"(.+\.(?:h5|hdf5|hdf))(?::(.*))?", re.IGNORECASE)
# What one slab read may hold (bytes): whole chunks along z, a few hundred MB at most.
SLAB_BYTES = 2**27


def split_hdf5(source) -> tuple[Path, str] | None:
    """``"FILE.h5:volumes/raw"`` -> (FILE.h5, "volumes/raw"); ``"FILE.h5"`` -> (FILE.h5, "");
    None for anything that does not name an HDF5 file (.h5, .hdf5, .hdf)."""
    m = _SPEC.fullmatch(str(source))
    if not m:
        return None
    return Path(m.group(1)), (m.group(2) or "").strip("/")


@dataclass
class HDF5Volume:
    """One 3D (z, y, x) dataset of an HDF5 file, by its sections along z."""

    what: str  # the option that named it, for messages: "--em", "--labels"
    file: Path
    dataset: str
    n: int  # sections (z)
    shape: tuple[int, int]  # (y, x) of one section
    dtype: np.dtype
    z_step: int = 1  # sections per stored chunk: slabs start on its multiples
    resolution: tuple[float, float, float] | None = None  # the ``resolution`` attribute, nm
    bad_resolution: str | None = None  # a ``resolution`` attribute that is not 3 sizes > 0

    @property
    def name(self) -> str:
        return f"{self.file}:{self.dataset}"

    def where(self, index: int) -> str:
        return f"{self.name} section {index}"

    def __len__(self) -> int:
        return self.n

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Sections ``start .. stop - 1`` as one (z, y, x) array."""
        import h5py

        try:
            with h5py.File(self.file, "r") as f:
                return np.asarray(f[self.dataset][start:stop])
        except (OSError, KeyError, ValueError) as e:  # a corrupt chunk, a filter not installed
            raise ImageStackError(
                f"{self.what}: cannot read sections {start}-{stop - 1} of {self.name}: {e}; "
                "re-copy the file, or rewrite the dataset with gzip or no compression") from e

    def read(self, index: int) -> np.ndarray:
        """Section ``index`` as a 2D array."""
        return self.read_range(index, index + 1)[0]


def slabs(volume, start: int, stop: int, budget: int = SLAB_BYTES):
    """``(first section, (z, y, x) array)`` for runs of sections ``start .. stop - 1`` of
    ``volume`` (an image stack or an HDF5 volume), each within ``budget`` bytes where one
    section allows it, and cut at the volume's chunk boundaries along z (``z_step``) so that
    no stored chunk is decompressed for more than two slabs."""
    section = int(np.prod(volume.shape)) * np.dtype(volume.dtype).itemsize
    step = max(1, getattr(volume, "z_step", 1))
    per = max(1, budget // max(section, 1))
    per = max(step, per // step * step)
    z = start
    while z < stop:
        end = min(stop, (z + per) // step * step)  # > z: per is a multiple of step
        yield z, volume.read_range(z, end)
        z = end


def _listing(f) -> list[str]:
    """``"volumes/raw (250, 250, 250) uint8"`` for every dataset of an open file."""
    import h5py

    found = []
    f.visititems(lambda name, obj: found.append(f"{name} {obj.shape} {obj.dtype}")
                 if isinstance(obj, h5py.Dataset) else None)
    return found


def _missing(file: Path, dataset: str, what: str, f) -> ImageStackError:
    found = _listing(f)
    names = [d.split(" ")[0] for d in found]
    close = difflib.get_close_matches(dataset, names, n=1, cutoff=0.5) if dataset else []
    held = "; ".join(found) if found else "no dataset at all"
    if not dataset:
        head = f"{what} {file}: name the dataset to read after the file name."
    elif dataset in f:
        head = f"{what} {file}:{dataset} is a group, not a dataset."
    else:
        head = f"{what} {file}: no dataset {dataset!r}" + (
            f"; did you mean {close[0]!r}?" if close else ".")
    volumes = [n for n in names if f[n].ndim == 3]
    if what == "--em":  # EM first: 3D volumes of 8- or 16-bit greys
        volumes.sort(key=lambda n: f[n].dtype not in (np.uint8, np.uint16))
    example = (close or volumes or names or ["volumes/raw"])[0]
    return ImageStackError(f"{head} The file holds: {held}. Give {what} {file}:{example} "
                           "(FILE.h5:DATASET, the path of a 3D dataset in the file)")


def _resolution(attrs) -> tuple[tuple[float, float, float] | None, str | None]:
    """The ``resolution`` attribute as three sizes in nm, or why it is not one."""
    if "resolution" not in attrs:
        return None, None
    raw = attrs["resolution"]
    shown = repr(raw.tolist() if isinstance(raw, np.ndarray) else raw)
    try:
        values = np.asarray(raw, dtype=float).ravel()
    except (TypeError, ValueError):
        return None, shown
    if values.shape != (3,) or not np.all(np.isfinite(values)) or values.min() <= 0:
        return None, shown
    return (float(values[0]), float(values[1]), float(values[2])), None


def _check_em_dtype(volume: HDF5Volume) -> None:
    if volume.dtype in (np.uint8, np.uint16):
        return
    if volume.dtype.kind == "f":
        how = "rescale it to 0..255 and store it as uint8 (or to 0..65535 as uint16)"
    else:
        how = "store it as uint8 or uint16 (e.g. numpy's astype after shifting it to >= 0)"
    raise ImageStackError(
        f"--em {volume.name} is {volume.dtype.name}; EM must be 8- or 16-bit unsigned "
        f"integers (uint8 or uint16), as for image sections: {how}")


def open_hdf5(source, what: str) -> HDF5Volume:
    """The 3D dataset that ``source`` (``FILE.h5:DATASET``) names, checked from its header:
    the file is HDF5, the dataset exists and is 3D, and EM is uint8 or uint16."""
    import h5py

    file, dataset = split_hdf5(source)
    if not file.is_file():
        raise ImageStackError(f"{what} {source}: no such file {file}" + (
            "" if file.parent.is_dir() else f" (no folder {file.parent})"))
    if not h5py.is_hdf5(file):
        raise ImageStackError(
            f"{what} {source}: {file} is not an HDF5 file (no HDF5 signature); give an HDF5 "
            "file as FILE.h5:DATASET, or a folder of section images")
    with h5py.File(file, "r") as f:
        obj = f.get(dataset) if dataset else None
        if not isinstance(obj, h5py.Dataset):
            raise _missing(file, dataset, what, f)
        if obj.ndim != 3:
            raise ImageStackError(
                f"{what} {file}:{dataset} has shape {obj.shape} ({obj.ndim}D); it must be one "
                "3D volume, (z, y, x): write the volume (one channel, one time point) as its own "
                "dataset and name that one")
        if 0 in obj.shape:
            raise ImageStackError(f"{what} {file}:{dataset} is empty (shape {obj.shape})")
        resolution, bad = _resolution(obj.attrs)
        volume = HDF5Volume(what, file, dataset, int(obj.shape[0]), tuple(obj.shape[1:]),
                            np.dtype(obj.dtype), int(obj.chunks[0]) if obj.chunks else 1,
                            resolution, bad)
    if what == "--em":
        _check_em_dtype(volume)
    return volume


def resolve_voxel_size(given, em, labels, log) -> tuple[float, float, float]:
    """The voxel size to write: ``given`` (``--voxel_size``), else the ``resolution``
    attribute of the EM's HDF5 dataset (or, failing that, of the labels'); a stack of images
    carries none."""
    sources = [v for v in (em, labels) if v is not None]
    if given is not None:
        voxel_size = tuple(float(v) for v in given)
        if len(voxel_size) != 3 or min(voxel_size) <= 0:
            raise ImageStackError(f"--voxel_size {list(voxel_size)}: expected 3 sizes in nm "
                                  "(z, y, x), each > 0, e.g. 50,4.6,4.6")
        for v in sources:
            if getattr(v, "resolution", None) not in (None, voxel_size):
                log(f"voxel size {_nm(voxel_size)} nm from --voxel_size ({v.name} says "
                    f"{_nm(v.resolution)} in its resolution attribute)")
        return voxel_size
    for v in sources:
        if getattr(v, "bad_resolution", None):
            raise ImageStackError(
                f"{v.what} {v.name}: its resolution attribute {v.bad_resolution} is not three "
                "sizes in nm (z, y, x) > 0; give the voxel size with --voxel_size z,y,x")
    found = [v for v in sources if getattr(v, "resolution", None) is not None]
    if not found:
        raise ImageStackError(
            f"--em {em.name}: no voxel size is stored with it (image sections carry none, an "
            "HDF5 dataset carries it as a 'resolution' attribute, z, y, x nm); give it with "
            "--voxel_size z,y,x in nm, e.g. --voxel_size 50,4.6,4.6")
    if len(found) == 2 and found[0].resolution != found[1].resolution:
        raise ImageStackError(
            f"--em {found[0].name} has resolution {_nm(found[0].resolution)} nm but --labels "
            f"{found[1].name} has {_nm(found[1].resolution)}; check that they are the same "
            "volume, then give the voxel size with --voxel_size z,y,x")
    log(f"voxel size {_nm(found[0].resolution)} nm (z, y, x) from the resolution attribute of "
        f"{found[0].name}")
    return found[0].resolution


def _nm(values) -> str:
    return ",".join(f"{float(v):g}" for v in values)
