"""The CellMap class names, which classes are made of which atomic parts, which are instances.

The table follows the CellMap segmentation challenge's class list (its ``classes.csv``): every
class has an id; a *composite* class is the union of *atomic* classes ("ids included"), e.g.
``mito = mito_mem + mito_lum + mito_ribo`` and ``cell`` = everything inside the plasma
membrane, the membrane included. A crop may annotate a composite class directly (its own
group) or only its parts; ``data/crops/reader.py`` composes the target from the parts then.

Names not in the table are fine for one's own data as long as some crop annotates them;
:func:`check_class_names` only rejects names that are neither (with a "did you mean").
"""

from __future__ import annotations

import difflib

from torchtitan.cellmap.errors import DatasetError

# (class id, name, long name, atomic parts by id; empty = atomic)
_TABLE: tuple[tuple[int, str, str, tuple[int, ...]], ...] = (
    (1, "ecs", "extracellular space", ()),
    (2, "pm", "plasma membrane", ()),
    (3, "mito_mem", "mitochondrial membrane", ()),
    (4, "mito_lum", "mitochondrial lumen", ()),
    (5, "mito_ribo", "mitochondrial ribosome", ()),
    (6, "golgi_mem", "Golgi membrane", ()),
    (7, "golgi_lum", "Golgi lumen", ()),
    (8, "ves_mem", "vesicle membrane", ()),
    (9, "ves_lum", "vesicle lumen", ()),
    (10, "endo_mem", "endosome membrane", ()),
    (11, "endo_lum", "endosome lumen", ()),
    (12, "lyso_mem", "lysosome membrane", ()),
    (13, "lyso_lum", "lysosome lumen", ()),
    (14, "ld_mem", "lipid droplet membrane", ()),
    (15, "ld_lum", "lipid droplet lumen", ()),
    (16, "er_mem", "endoplasmic reticulum membrane", ()),
    (17, "er_lum", "endoplasmic reticulum lumen", ()),
    (18, "eres_mem", "ER exit site membrane", ()),
    (19, "eres_lum", "ER exit site lumen", ()),
    (20, "ne_mem", "nuclear envelope membrane", ()),
    (21, "ne_lum", "nuclear envelope lumen", ()),
    (22, "np_out", "nuclear pore out", ()),
    (23, "np_in", "nuclear pore in", ()),
    (24, "hchrom", "heterochromatin", ()),
    (25, "nhchrom", "nucleolus-associated heterochromatin", ()),
    (26, "echrom", "euchromatin", ()),
    (27, "nechrom", "nucleolus-associated euchromatin", ()),
    (28, "nucpl", "nucleoplasm", ()),
    (29, "nucleo", "nucleolus", ()),
    (30, "mt_out", "microtubule out", ()),
    (31, "cent", "centrosome", ()),
    (32, "cent_dapp", "centrosome distal appendage", ()),
    (33, "cent_sdapp", "centrosome subdistal appendage", ()),
    (34, "ribo", "ribosomes", ()),
    (35, "cyto", "cytosol", ()),
    (36, "mt_in", "microtubule in", ()),
    (37, "nuc", "nucleus", tuple(range(20, 30))),
    (38, "vim", "vimentin", ()),
    (39, "glyco", "glycogen", ()),
    (40, "golgi", "Golgi", (6, 7)),
    (41, "ves", "vesicle", (8, 9)),
    (42, "endo", "endosome", (10, 11)),
    (43, "lyso", "lysosome", (12, 13)),
    (44, "ld", "lipid droplet", (14, 15)),
    (45, "rbc", "red blood cells", ()),
    (46, "eres", "ER exit site", (18, 19)),
    (47, "perox_mem", "peroxisome membrane", ()),
    (48, "perox_lum", "peroxisome lumen", ()),
    (49, "perox", "peroxisome", (47, 48)),
    (50, "mito", "mitochondria", (3, 4, 5)),
    (51, "er", "endoplasmic reticulum", tuple(range(16, 24))),
    (52, "ne", "nuclear envelope", (20, 21, 22, 23)),
    (53, "np", "nuclear pore", (22, 23)),
    (54, "chrom", "chromatin", (24, 25, 26, 27)),
    (55, "mt", "microtubule", (30, 36)),
    (56, "isg_mem", "insulin secretory granule membrane", ()),
    (57, "isg_lum", "insulin secretory granule lumen", ()),
    (58, "isg_ins", "insulin secretory granule insulin", ()),
    (59, "isg", "insulin secretory granule", (56, 57, 58)),
    # Everything inside the cell, its plasma membrane included (not ecs, rbc, bm).
    (60, "cell", "cell", (*range(2, 37), 38, 39, 47, 48, 56, 57, 58, 61, 62)),
    (61, "actin", "actin", ()),
    (62, "tbar", "t-bar", ()),
    (63, "bm", "basement membrane", ()),
    (64, "er_mem_all", "ER membrane collective", (16, 18, 20)),
    (65, "ne_mem_all", "nuclear envelope membrane collective", (20, 22, 23)),
    (66, "cent_all", "centrosome collective", (31, 32, 33)),
    (67, "chlor_mem", "chloroplast membrane", ()),
    (68, "chlor_lum", "chloroplast lumen", ()),
    (69, "chlor_sg", "chloroplast starch granule", ()),
    (70, "chlor", "chloroplast", (67, 68, 69)),
    (71, "vac_mem", "vacuole membrane", ()),
    (72, "vac_lum", "vacuole lumen", ()),
    (73, "vac", "vacuole", (71, 72)),
    (74, "pd", "plasmodesmata", ()),
    (75, "yolk_mem", "yolk organelle membrane", ()),
    (76, "yolk_lum", "yolk organelle lumen", ()),
    (77, "yolk", "yolk organelle", (75, 76)),
)

_NAME_OF_ID = {cid: name for cid, name, _, _ in _TABLE}

CLASS_IDS: dict[str, int] = {name: cid for cid, name, _, _ in _TABLE}
CLASS_LONG_NAMES: dict[str, str] = {name: long for _, name, long, _ in _TABLE}
CELLMAP_CLASSES: tuple[str, ...] = tuple(CLASS_IDS)

# Composite class -> its atomic parts (names). Atomic classes are not listed.
CLASS_PARTS: dict[str, tuple[str, ...]] = {
    name: tuple(_NAME_OF_ID[i] for i in parts) for _, name, _, parts in _TABLE if parts
}

# The challenge's instance classes, as its evaluation code lists them (``INSTANCE_CLASSES`` of
# cellmap-segmentation-challenge): scored per object; every other class is scored semantically.
# This tuple is the one owner of that fact (scoring, validation, submissions and post-processing
# import it).
INSTANCE_CLASSES: tuple[str, ...] = (
    "nuc", "vim", "ves", "endo", "lyso", "ld", "perox", "mito", "np", "mt", "cell",
)

# The classes scored also as dense segmentations, with the metrics neuron segmentation is
# judged by (variation of information split / merge, adapted Rand error; CREMI's definitions,
# ``torchtitan/scoring/neuron_metrics.py``): neuron bodies are ``cell`` instances, and these metrics
# weigh a false merge or split of large, touching cells by its volume. Each is an instance class.
NEURON_CLASSES: tuple[str, ...] = ("cell",)

# Instance class -> the membrane class that bounds each of its objects: where both are
# predicted, the membrane's boundaries cut the class's mask into objects (neurons from their
# plasma membranes in dense neuropil, where the mask of ``cell`` is one object).
MEMBRANE_OF: dict[str, str] = {"cell": "pm"}


def atoms(name: str) -> frozenset[str]:
    """The atomic classes that make up ``name`` (itself when atomic or not in the table)."""
    return frozenset(CLASS_PARTS.get(name, (name,)))


def is_instance_class(name: str) -> bool:
    return name in INSTANCE_CLASSES


def class_name_hint(name: str, extra=()) -> str:
    """``"; did you mean 'mito'?"`` for the known name closest to ``name`` (a CellMap class
    or one of ``extra``), ``"."`` when none is close."""
    known = list(CELLMAP_CLASSES) + [e for e in extra if e not in CLASS_IDS]
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else "."


def check_class_names(classes, extra=(), label: str = "data.classes") -> None:
    """Raise a DatasetError naming the first class that is neither a CellMap class nor in
    ``extra`` (e.g. the names the crops on disk annotate), with the closest known name;
    ``label`` names where the classes came from (a config key or a command-line flag)."""
    known = list(CELLMAP_CLASSES) + [e for e in extra if e not in CLASS_IDS]
    for name in classes:
        if name in CLASS_IDS or name in extra:
            continue
        hint = class_name_hint(name, extra)
        raise DatasetError(
            f"{label}: unknown class {name!r}: not a CellMap class and annotated by no "
            f"crop{hint} Known classes: {', '.join(known)}"
        )
