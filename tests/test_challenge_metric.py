"""The CellMap challenge's 2025 metric, number for number, and one definition for validation
and the scoring command.

The expectations are worked out by hand from the challenge's scoring code
(janelia-cellmap/cellmap-segmentation-challenge, ``utils/eval_utils``): the prediction is
relabelled into connected components numbered in raster order; matched components take their
true instance's id, unmatched ones keep their number, and each true instance's Hausdorff
distance is taken to every predicted voxel that then carries its id.

Two crops of 16^3 voxels of 8 nm (cap: half the shortest side, 64 nm; voxel diagonal 8 sqrt 3,
so a distance of d voxels normalises to 1.01^(-d / sqrt 3)):

* crop 1, the collision: true mitochondria 1 (z, y, x in 2..4) and 2 (in 10..12).
  Predicted components, in raster order: c1 just above instance 1 (z 0..1, touching no true
  voxel), c2 above instance 2 (z 6..7), c3 = instance 2 shifted by one voxel in x. Only c3
  overlaps anything: it matches 2 (IoU 1/2). Unmatched c1 keeps number 1 and stands in for
  missed instance 1 (distance 3 voxels: z 4 to z 1); unmatched c2 keeps number 2 and joins c3
  (distance 4: z 6 to z 10). Distances 3, 4 and the cap (8 voxels) for c1 and c2:
  TP 1, FP 2, FN 1.
* crop 2, no collision: true 1, 2 and 7; c1 = 1 shifted by one voxel in x (distance 1),
  c2 = 2 shifted by two in y (distance 2), c3 below 7 (z 13..15 under z 9..11), touching
  nothing; 7 is missed and no component is numbered 7: the cap for 7 and for c3.
  TP 2, FP 1, FN 1.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.cellmap.labels import annotation_attrs
from torchtitan.cellmap.ome_ngff import write_multiscale_array_group
from torchtitan.scoring.metrics import instance_scores

REPO = Path(__file__).resolve().parents[1]
VOXEL = (8.0, 8.0, 8.0)
SHAPE = (16, 16, 16)


def h(d_voxels: float) -> float:
    """A distance of ``d_voxels`` voxels of 8 nm, normalised as the challenge does."""
    return 1.01 ** (-d_voxels / math.sqrt(3))


def volume(dtype, *boxes) -> np.ndarray:
    """``boxes``: (value, (z0, z1), (y0, y1), (x0, x1)), half-open voxel ranges."""
    out = np.zeros(SHAPE, dtype)
    for value, z, y, x in boxes:
        out[z[0]:z[1], y[0]:y[1], x[0]:x[1]] = value
    return out


TRUTH_1 = volume(np.uint16, (1, (2, 5), (2, 5), (2, 5)), (2, (10, 13), (10, 13), (10, 13)))
PRED_1 = volume(bool, (1, (0, 2), (2, 5), (2, 5)), (1, (6, 8), (10, 13), (10, 13)),
                (1, (10, 13), (10, 13), (11, 14)))
TRUTH_2 = volume(np.uint16, (1, (1, 4), (1, 4), (1, 4)), (2, (6, 9), (6, 9), (6, 9)),
                 (7, (9, 12), (12, 15), (12, 15)))
PRED_2 = volume(bool, (1, (1, 4), (1, 4), (2, 5)), (1, (6, 9), (8, 11), (6, 9)),
                (1, (13, 16), (12, 15), (12, 15)))
# Semantic er: crop 1 a 4^3 cube predicted one voxel off in x (TP 48, FP 16, FN 16); crop 2
# a 2^3 cube not predicted (FN 8). Pooled IoU 48 / 88 = 6/11.
ER_TRUTH_1 = volume(np.uint8, (1, (4, 8), (4, 8), (4, 8)))
ER_PRED_1 = volume(bool, (1, (4, 8), (4, 8), (5, 9)))
ER_TRUTH_2 = volume(np.uint8, (1, (12, 14), (12, 14), (12, 14)))
ER_PRED_2 = np.zeros(SHAPE, bool)

# By hand (module docstring). Normalised sums per crop, to 1e-6:
SUM_1 = h(3) + h(4) + 2 * h(8)  # 3.870359
SUM_2 = h(1) + h(2) + 2 * h(8)  # 3.893011
# mito over both crops: TP 3, FP 3, FN 2 -> F1 6/11; 8 distances.
MITO = math.sqrt(6 / 11 * (SUM_1 + SUM_2) / 8)  # 0.727544
# vim is an instance class of the challenge: crop 2 annotates it with crop 1's arrays.
VIM = math.sqrt(2 / 5 * SUM_1 / 4)  # 0.622122
ER = 6 / 11
OVERALL = math.sqrt(ER * (MITO + VIM) / 2)  # 0.606705


def test_hand_values():
    """The hand-worked numbers themselves, written out."""
    assert SUM_1 == pytest.approx(3.870359, abs=1e-6)
    assert SUM_2 == pytest.approx(3.893011, abs=1e-6)
    assert (MITO, VIM, OVERALL) == pytest.approx((0.727544, 0.622122, 0.606705), abs=1e-6)


def test_collision_case():
    s = instance_scores(PRED_1, TRUTH_1, VOXEL)
    assert (s["n_true"], s["n_pred"], s["tp"], s["fp"], s["fn"]) == (2, 3, 1, 2, 1)
    # One distance per true instance (ids 1, 2): both come from the collision.
    assert s["hausdorff_nm"] == [24.0, 32.0]
    assert s["n_hausdorff"] == 4
    assert s["hausdorff_norm_sum"] == pytest.approx(SUM_1, abs=1e-6)
    assert s["f1"] == pytest.approx(2 / 5)
    assert s["score"] == pytest.approx(math.sqrt(2 / 5 * SUM_1 / 4), abs=1e-6)
    # Only the matched pair alone (c3 against 2) is 1 voxel off; the collision makes it 4.
    assert s["mean_hausdorff_nm"] == 32.0


def test_no_collision_case():
    s = instance_scores(PRED_2, TRUTH_2, VOXEL)
    assert (s["n_true"], s["n_pred"], s["tp"], s["fp"], s["fn"]) == (3, 3, 2, 1, 1)
    assert s["hausdorff_nm"] == [8.0, 16.0, 64.0]  # ids 1, 2, 7; 7 missed: the cap
    assert s["n_hausdorff"] == 4
    assert s["hausdorff_norm_sum"] == pytest.approx(SUM_2, abs=1e-6)
    assert s["f1"] == pytest.approx(2 / 3)


def test_stored_ids_decide_the_collision_not_their_rank():
    """True ids are used as stored: the same objects stored as 1, 2 and 3 (instead of 1, 2,
    7) meet the unmatched component c3 (number 3), which then stands in for the missed
    instance: 4 voxels (z 11 to z 13, z 15 to z 11) instead of the cap."""
    renumbered = np.where(TRUTH_2 == 7, 3, TRUTH_2).astype(np.uint16)
    s = instance_scores(PRED_2, renumbered, VOXEL)
    assert s["hausdorff_nm"] == [8.0, 16.0, 32.0]
    assert s["hausdorff_norm_sum"] == pytest.approx(SUM_2 - h(8) + h(4), abs=1e-6)


def test_vim_is_an_instance_class():
    assert "vim" in INSTANCE_CLASSES


# ---------------------------------------------------------------------------------------------
# Validation's val/score and the scoring command: one definition, the same numbers
# ---------------------------------------------------------------------------------------------

CLASSES = ["mito", "vim", "er"]
# Validation crops: what each annotates, as (truth, prediction) per class.
CROPS = {
    "crop1": {"mito": (TRUTH_1, PRED_1), "er": (ER_TRUTH_1, ER_PRED_1)},
    "crop2": {"mito": (TRUTH_2, PRED_2), "vim": (TRUTH_1, PRED_1), "er": (ER_TRUTH_2, ER_PRED_2)},
}


def _crop_translation(number: int):
    """Crop N sits 16 (N - 1) voxels down in z; translation = centre of voxel 0 (nm)."""
    return (VOXEL[0] * (16 * (number - 1) + 0.5), VOXEL[1] / 2, VOXEL[2] / 2)


def _em_of(predicted: dict[str, np.ndarray]) -> np.ndarray:
    """EM whose value 1 + 2 * code encodes the predicted classes (bit k: class k)."""
    code = sum((predicted[c].astype(np.uint8) << k for k, c in enumerate(CLASSES) if c in predicted),
               np.zeros(SHAPE, np.uint8))
    return (1 + 2 * code).astype(np.uint8)


class DecodeEM(torch.nn.Module):
    """A stand-in network: reads the predicted masks back from the EM values (inverting the
    loader's normalisation x = v / 127.5 - 1) and returns confident logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = torch.round((x + 1) * 127.5).long()
        code = torch.div(value - 1, 2, rounding_mode="floor")
        bits = [((code >> k) & 1).float() for k in range(len(CLASSES))]
        return (torch.cat(bits, dim=1) - 0.5) * 40


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One dataset: crops 1 and 2 (validation) and 3 (training), 8 nm, on the EM's grid."""
    root = tmp_path_factory.mktemp("challenge") / "data"
    zpath = root / "jrc_metric-1" / "jrc_metric-1.zarr"
    group = zarr.open_group(str(zpath), mode="w", zarr_format=2)
    train = {"mito": (TRUTH_2, PRED_2), "vim": (TRUTH_1, PRED_1), "er": (ER_TRUTH_1, ER_PRED_1)}
    em = np.concatenate([_em_of({c: p for c, (_, p) in crop.items()})
                         for crop in (CROPS["crop1"], CROPS["crop2"], train)])
    write_multiscale_array_group(group, "recon-1/em/fibsem-uint8", [em], VOXEL,
                                 tuple(v / 2 for v in VOXEL))
    for number, crop in enumerate((CROPS["crop1"], CROPS["crop2"], train), start=1):
        for cls, (truth, _) in crop.items():
            write_multiscale_array_group(
                group, f"recon-1/labels/groundtruth/crop{number}/{cls}", [truth], VOXEL,
                _crop_translation(number),
                extra_attrs=annotation_attrs(cls, truth, instances=cls in INSTANCE_CLASSES))
    return root


def _write_predictions(path: Path, masks: dict[str, dict[str, np.ndarray]]) -> Path:
    pred = zarr.open_group(str(path), mode="w", zarr_format=2)
    for crop, by_class in masks.items():
        for cls, mask in by_class.items():
            arr = pred.require_group(crop).create_array(cls, data=mask.astype(np.uint8))
            arr.attrs.update(voxel_size=list(VOXEL), translation=list(_crop_translation(int(crop[4:]))))
    return path


def _score_command(predictions: Path, groundtruth: Path, out: Path, *extra: str):
    proc = subprocess.run([sys.executable, "-m", "torchtitan.scoring", "--predictions",
                           str(predictions), "--groundtruth", str(groundtruth), "--out", str(out),
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_validation_logs_what_the_scoring_command_prints(store, tmp_path):
    from torchtitan.config.manager import ConfigManager
    from torchtitan.tasks.base import ValidationContext
    from torchtitan.tasks.segmentation import SegmentationTask

    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_3d.toml",
        "--data.dataset_path", str(store), "--data.classes", ",".join(CLASSES),
        "--data.voxel_size", "8,8,8", "--data.val_crops", "crop1,crop2",
        "--model.crop_size", "16,16,16", "--job.dump_folder", str(tmp_path / "dump")])
    seen: dict[str, dict[str, np.ndarray]] = {}

    def capture(out_dir, name, step, em, truth, pred, classes, valid=None, writer=None):
        seen[name] = {c: pred[k] for k, c in enumerate(classes)}

    task = SegmentationTask(cfg, visuals=capture)
    task.prepare()
    scores = task.validate(DecodeEM(), ValidationContext(device=torch.device("cpu"), step=1))

    # Validation predicted exactly the designed masks ...
    masks = {}
    for full_name, by_class in seen.items():
        crop = full_name.split("/")[-1]
        masks[crop] = {c: by_class[c] for c in CROPS[crop]}
        for c, (_, designed) in CROPS[crop].items():
            assert np.array_equal(by_class[c], designed), (crop, c)
    assert set(masks) == {"crop1", "crop2"}
    # ... and scored them as the challenge does.
    assert scores["val/instance_score/mito"] == pytest.approx(MITO, abs=1e-6)
    assert scores["val/instance_score/vim"] == pytest.approx(VIM, abs=1e-6)
    assert scores["val/iou/er"] == pytest.approx(ER, abs=1e-12)
    assert scores["val/score"] == pytest.approx(OVERALL, abs=1e-6)

    # The same masks, as a submission, through the scoring command.
    stdout, result = _score_command(_write_predictions(tmp_path / "pred.zarr", masks), store,
                                    tmp_path / "scores.json")
    assert result["overall"]["score"] == pytest.approx(scores["val/score"], abs=1e-12)
    assert result["overall"]["mean_instance_score"] == pytest.approx(
        scores["val/mean_instance_score"], abs=1e-12)
    for cls in ("mito", "vim"):
        assert result["classes"][cls]["score"] == pytest.approx(
            scores[f"val/instance_score/{cls}"], abs=1e-12)
    assert f"overall score {OVERALL:.3f}" in stdout


def test_a_half_with_no_class_is_not_scored(store, tmp_path, capsys):
    """Scoring only instance classes (or only semantic ones): the missing half says so, and a
    perfect prediction scores 1, not sqrt(1 x 0). (The command's main, in process: the run
    above covers the module entry.)"""
    from torchtitan.scoring.stores import main

    perfect = {crop: {c: truth for c, (truth, _) in by_class.items()} for crop, by_class in CROPS.items()}
    pred = _write_predictions(tmp_path / "perfect.zarr", {
        crop: {c: (t > 0) if c not in INSTANCE_CLASSES else t for c, t in by_class.items()}
        for crop, by_class in perfect.items()})
    for classes, line in (("mito,vim", "semantic score not scored  instance score 1.000  "
                                       "overall score 1.000"),
                          ("er", "semantic score 1.000  instance score not scored  "
                                 "overall score 1.000")):
        out = tmp_path / f"{classes}.json"
        assert main(["--predictions", str(pred), "--groundtruth", str(store), "--out", str(out),
                     "--classes", classes]) == 0
        stdout = capsys.readouterr().out
        assert line in stdout, stdout
        result = json.loads(out.read_text())
        assert result["overall"]["score"] == 1.0
        missing = "mean_semantic_iou" if classes == "mito,vim" else "mean_instance_score"
        assert result["overall"][missing] is None
