"""Tests of the pictures: overlays, comparison frames, GIFs, TensorBoard images, MAE frames and
the two plotting helpers (run as subprocesses on a small demo set)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from PIL import Image

from conftest import script_module
from torchtitan.demo.data import generate_demo_data
from torchtitan.data.io.stores import StoreContext
from torchtitan.pictures.drawing import (
    CLASS_COLORS,
    GAP,
    HATCH_GREY,
    class_color,
    default_font,
    line_height,
    overlay,
)
from torchtitan.pictures.visualization import (
    comparison_frames,
    frame_slices,
    frames_to_tensorboard_image,
    grid_frames,
    mae_frame,
    sanitize_name,
    save_gif,
    write_mae_visuals,
    write_validation_visuals,
)

REPO = Path(__file__).resolve().parents[1]
GREY = 100  # EM grey level of the hand-made test slices


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vis_demo")
    generate_demo_data(root, scale=0.25)
    return root


def blend(color, alpha=0.45, grey=GREY) -> np.ndarray:
    """The colour overlay() gives an interior pixel of one class over flat grey EM."""
    return np.round((1 - alpha) * grey + alpha * np.asarray(color, float))


def square_masks(k=2, h=32, w=40):
    """K masks on an (h, w) slice: class 0 a square, class 1 a smaller square inside it."""
    masks = np.zeros((k, h, w), bool)
    masks[0, 4:20, 4:30] = True
    if k > 1:
        masks[1, 8:14, 10:18] = True
    return masks


# ---------------------------------------------------------------------------------------------
# Colours and single slices
# ---------------------------------------------------------------------------------------------


def test_class_colours_are_fixed_distinct_and_have_a_fallback():
    main = ["ecs", "pm", "cell", "nuc", "mito", "mito_mem", "mito_lum", "er", "ves", "ld", "endo",
            "lyso", "perox", "mt", "np", "golgi"]
    for name in main:
        assert name in CLASS_COLORS and class_color(name) == CLASS_COLORS[name]
    assert len({CLASS_COLORS[n] for n in main}) == len(main)
    unknown = class_color("some_new_class")
    assert unknown == class_color("some_new_class")  # deterministic
    assert len(unknown) == 3 and all(0 <= c <= 255 for c in unknown)
    assert max(unknown) - min(unknown) > 40  # saturated, i.e. not grey like the EM


def test_overlay_colours_where_masks_are():
    em = np.full((32, 40), GREY, np.uint8)
    masks = square_masks()
    out = overlay(em, masks, ["mito", "ld"])
    assert out.shape == (32, 40, 3) and out.dtype == np.uint8
    assert (out[0, 0] == GREY).all() and (out[30, 38] == GREY).all()  # outside every mask: EM
    # Interior of the big class: its colour blended with the EM.
    np.testing.assert_allclose(out[6, 8], blend(class_color("mito")), atol=1)
    # The small class nested inside stays visible on top of the big one.
    np.testing.assert_allclose(out[10, 13], blend(class_color("ld")), atol=1)
    # Outlines are drawn in (nearly) full colour.
    edge = out[4, 20].astype(float)
    assert np.abs(edge - np.asarray(class_color("mito"))).max() < 40


def test_overlay_draws_big_classes_faintly():
    em = np.full((32, 40), GREY, np.uint8)
    masks = np.ones((1, 32, 40), bool)  # e.g. "cell", covering the whole slice
    out = overlay(em, masks, ["cell"]).astype(int)
    tinted = np.abs(out[16, 20] - GREY).max()
    assert 0 < tinted < np.abs(blend(class_color("cell")) - GREY).max()


def test_overlay_takes_float_em_torch_masks_and_rgb_colours():
    em = torch.linspace(-1, 1, 32 * 40).reshape(32, 40)
    masks = torch.from_numpy(square_masks(1)).float()
    out = overlay(em, masks, [(255, 0, 0)])
    assert out.shape == (32, 40, 3)
    assert out[12, 20, 0] > out[12, 20, 1] + 50  # red inside
    assert out[0, 0, 0] == out[0, 0, 1] == out[0, 0, 2]  # grey outside


def test_overlay_marks_invalid_regions_distinctly():
    em = np.full((32, 40), GREY, np.uint8)
    masks = square_masks()
    valid = np.ones((2, 32, 40), bool)
    valid[:, 24:] = False  # unknown for every class: hatched
    valid[1, :8] = False  # unknown for one class only: still drawn normally
    out = overlay(em, masks, ["mito", "ld"], valid=valid)
    plain = overlay(em, masks, ["mito", "ld"])
    invalid = out[24:]
    # Changed from the plain overlay, grey (no class colour) and striped: two grey levels.
    assert (invalid != plain[24:]).any()
    assert (invalid[..., 0] == invalid[..., 1]).all() and (invalid[..., 1] == invalid[..., 2]).all()
    levels = np.unique(invalid[..., 0])
    assert HATCH_GREY in levels and len(levels) >= 2
    np.testing.assert_array_equal(out[:24], plain[:24])


# ---------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------


def _has_colour(panel: np.ndarray, colour: np.ndarray) -> bool:
    return bool((np.abs(panel.astype(int) - colour).max(axis=-1) <= 1).any())


def test_comparison_frames_size_count_and_colours():
    depth, h, w = 40, 20, 30
    em = np.full((depth, h, w), GREY, np.uint8)
    truth = np.zeros((2, depth, h, w), bool)
    truth[0, :, 4:12, 4:16] = True
    pred = np.zeros_like(truth)
    pred[1, :, 6:14, 6:20] = True
    frames = comparison_frames(em, truth, pred, ["mito", "nuc"], max_frames=32)
    assert len(frames) == 32
    s = 9  # ceil(256 / 30): at least ~256 pixels per panel
    panel_w = w * s
    assert {f.size for f in frames} == {frames[0].size}
    assert frames[0].width == 3 * panel_w + 4 * GAP
    assert frames[0].height > h * s
    pixels = np.asarray(frames[0])
    em_cols = pixels[:, GAP:GAP + panel_w]
    truth_cols = pixels[:, 2 * GAP + panel_w:2 * GAP + 2 * panel_w]
    pred_cols = pixels[:, 3 * GAP + 2 * panel_w:3 * GAP + 3 * panel_w]
    mito, nuc = blend(class_color("mito")), blend(class_color("nuc"))
    assert _has_colour(truth_cols, mito) and not _has_colour(truth_cols, nuc)
    assert _has_colour(pred_cols, nuc) and not _has_colour(pred_cols, mito)
    assert not _has_colour(em_cols, mito) and not _has_colour(em_cols, nuc)
    # Fewer slices than max_frames: one frame each.
    assert len(comparison_frames(em[:5], truth[:, :5], pred[:, :5], ["mito", "nuc"])) == 5


def test_frame_slices_even_and_inclusive():
    assert frame_slices(5, 32) == [0, 1, 2, 3, 4]
    z = frame_slices(100, 10)
    assert len(z) == 10 and z[0] == 0 and z[-1] == 99
    assert np.ptp(np.diff(z)) <= 1


def test_comparison_frames_2d_and_without_prediction():
    em = torch.rand(1, 24, 24) * 2 - 1  # (C=1, H, W) normalised EM, as the validation uses
    truth = torch.zeros(1, 24, 24, dtype=torch.bool)
    truth[0, 4:12, 4:12] = True
    frames = comparison_frames(em[0], truth, torch.rand(1, 24, 24), ["er"])
    assert len(frames) == 1
    assert frames[0].width == 3 * 24 * 11 + 4 * GAP  # ceil(256 / 24) = 11
    two = comparison_frames(em[0], truth, None, ["er"])
    assert len(two) == 1 and two[0].width == 2 * 24 * 11 + 3 * GAP


def test_comparison_frames_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="channels"):
        comparison_frames(np.zeros((4, 8, 8)), np.zeros((2, 4, 8, 8)), None, ["mito"])
    with pytest.raises(ValueError, match="truth"):
        comparison_frames(np.zeros((4, 8, 8)), np.zeros((1, 4, 8, 9)), None, ["mito"])


def test_grid_frames_step_through_normalised_depth():
    tiles = []
    for depth, size in [(4, 16), (10, 40), (7, 300)]:
        masks = np.zeros((1, depth, size, size), bool)
        masks[0, :, : size // 2, : size // 2] = True
        tiles.append({"em": np.full((depth, size, size), GREY, np.uint8), "masks": masks, "title": f"d{depth}"})
    frames = grid_frames(tiles, ["mito"], cols=2, max_frames=8, tile_px=128)
    assert len(frames) == 8
    assert frames[0].width == 2 * (128 + GAP) + GAP
    assert _has_colour(np.asarray(frames[3]), blend(class_color("mito")))


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def test_save_gif_is_animated_and_atomic(tmp_path):
    frames = comparison_frames(np.random.default_rng(0).integers(0, 255, (6, 16, 16), dtype=np.uint8),
                               np.ones((1, 6, 16, 16), bool), np.zeros((1, 6, 16, 16), bool), ["ves"])
    path = save_gif(frames, tmp_path / "sub" / "vol.gif", duration_ms=80)
    assert path == tmp_path / "sub" / "vol.gif"
    assert os.listdir(tmp_path / "sub") == ["vol.gif"]  # no temporary file left behind
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.is_animated and gif.n_frames == 6
        assert gif.size == frames[0].size
        assert gif.info.get("duration") == 80
        # The shared palette keeps the legend's class colour exact (a small swatch that an
        # adaptive palette alone would merge into a neighbouring colour).
        gif.seek(3)
        pixels = np.asarray(gif.convert("RGB")).reshape(-1, 3)
        assert (pixels == np.asarray(class_color("ves"))).all(axis=1).any()


def test_tensorboard_image_and_validation_visuals(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    d, h, w = 8, 20, 20
    em = torch.rand(1, d, h, w) * 2 - 1
    truth = torch.zeros(2, d, h, w, dtype=torch.bool)
    truth[0, :, 5:15, 5:15] = True
    prob = torch.rand(2, d, h, w)
    valid = torch.ones(2, d, h, w, dtype=torch.bool)
    valid[:, :, 15:] = False

    frame = comparison_frames(em, truth, prob, ["mito", "nuc"], valid=valid)[0]
    chw = frames_to_tensorboard_image(frame)
    assert chw.shape == (3, frame.height, frame.width) and chw.dtype == np.uint8

    logdir = tmp_path / "logs"
    writer = SummaryWriter(str(logdir))
    path = write_validation_visuals(tmp_path / "visuals", "jrc_synth-1/crop1", 30, em, truth, prob,
                                    ["mito", "nuc"], valid=valid, writer=writer)
    writer.close()
    assert path == tmp_path / "visuals" / "jrc_synth-1_crop1_step30.gif"
    with Image.open(path) as gif:
        assert gif.is_animated and gif.n_frames == d
        size = gif.size

    events = EventAccumulator(str(logdir), size_guidance={IMAGES: 0})
    events.Reload()
    assert events.Tags()["images"] == ["visuals/jrc_synth-1_crop1"]
    (image,) = events.Images("visuals/jrc_synth-1_crop1")
    assert image.step == 30 and (image.width, image.height) == size
    import io

    decoded = Image.open(io.BytesIO(image.encoded_image_string))
    assert decoded.size == size


def test_mae_visuals_write_a_png_and_a_tensorboard_image(tmp_path):
    """The writer train_mae.py hands to the MAE task."""
    from torch.utils.tensorboard import SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    img = torch.randn(3, 1, 32, 32)  # three samples: three rows
    masked = img.clone()
    masked[:, :, :16, :16] = float("nan")
    writer = SummaryWriter(str(tmp_path / "logs"))
    path = write_mae_visuals(tmp_path / "visuals", 7, img, masked, img * 0.9, writer=writer)
    writer.close()
    assert path == tmp_path / "visuals" / "mae_step7.png"
    row = mae_frame(img[0], masked[0], img[0] * 0.9, title="step 7")
    with Image.open(path) as png:
        assert png.size == (row.width, 3 * row.height)
        # Each row is that sample's frame.
        third = png.crop((0, 2 * row.height, row.width, 3 * row.height))
        expected = mae_frame(img[2], masked[2], img[2] * 0.9, title="step 7, validation sample 3")
        assert np.array_equal(np.asarray(third.convert("RGB")), np.asarray(expected))
    events = EventAccumulator(str(tmp_path / "logs"), size_guidance={IMAGES: 0})
    events.Reload()
    (image,) = events.Images("visuals/mae")
    assert image.step == 7


def test_sanitize_name():
    assert sanitize_name("jrc_synth-1/crop1") == "jrc_synth-1_crop1"
    assert sanitize_name("../x y") == "x_y"
    assert sanitize_name("///") == "volume"


def test_mae_frame_2d_3d_and_masked_patches():
    img = torch.randn(1, 32, 32)
    masked = img.clone()
    masked[:, :16, :16] = float("nan")  # a masked patch
    frame = mae_frame(img, masked, img * 0.9)
    assert frame.width == 3 * 32 * 8 + 4 * GAP  # ceil(256 / 32) = 8
    pixels = np.asarray(frame)
    top = frame.height - GAP - 32 * 8  # the panels sit at the bottom (no legend)
    masked_panel = pixels[top:, GAP:GAP + 256]  # first: what the model saw
    patch = masked_panel[:128, :128]
    assert set(np.unique(patch)) <= {30, 55}  # the dark checkerboard
    original = pixels[top:, 3 * GAP + 512:3 * GAP + 768]  # last: the input itself
    assert len(np.unique(original[:128, :128])) > 2
    vol = mae_frame(torch.randn(1, 5, 16, 16), torch.randn(1, 5, 16, 16), torch.randn(1, 5, 16, 16))
    assert vol.width == 3 * 16 * 16 + 4 * GAP
    with pytest.raises(ValueError, match="shapes differ"):
        mae_frame(torch.randn(1, 8, 8), torch.randn(1, 8, 9), torch.randn(1, 8, 8))


# ---------------------------------------------------------------------------------------------
# Command-line helpers on the demo data
# ---------------------------------------------------------------------------------------------


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "helpers" / script), *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _write_predictions(demo_root: Path, out: Path, crop_name: str, classes: list[str]) -> None:
    """A prediction zarr in the submission layout: the crop's ground truth, shifted in x."""
    from torchtitan.data.crops.layout import discover

    crop = next(c for s in discover(StoreContext(), demo_root) for c in s.crops if c.name == crop_name)
    root = zarr.open_group(str(out), mode="w", zarr_format=2)
    for cls in classes:
        level = crop.classes[cls][0]
        labels = np.asarray(zarr.open_array(level.path, mode="r"))
        pred = np.roll(labels == 1, 2, axis=2).astype(np.uint8)
        arr = root.create_array(f"{crop_name}/{cls}", shape=pred.shape, dtype="uint8", chunks=pred.shape)
        arr[:] = pred
        arr.attrs["voxel_size"] = list(level.scale)
        arr.attrs["translation"] = list(level.translation)


def test_plot_volumes_single_cli_with_predictions(demo_root, tmp_path):
    # One store (not the root folder), a class subset, an explicit voxel size, predictions.
    store = demo_root / "jrc_synth-1" / "jrc_synth-1.zarr"
    classes = ["cell", "mito", "er"]
    preds = tmp_path / "pred.zarr"
    _write_predictions(demo_root, preds, "crop2", classes)
    out, png = tmp_path / "crop2.gif", tmp_path / "crop2.png"
    result = _run("plot_volumes_single.py", "--zarr", str(store), "--crop", "crop2", "--classes", ",".join(classes),
                  "--voxel_size", "8,8,8", "--predictions", str(preds), "--out", str(out), "--png", str(png),
                  "--max_frames", "6")
    assert "wrote" in result.stdout
    with Image.open(out) as gif:
        assert gif.is_animated and gif.n_frames == 6
    # The middle frame: EM | ground truth | prediction, square panels (the crop is square).
    frame = np.asarray(Image.open(png).convert("RGB")).astype(int)
    panel_w = (frame.shape[1] - 4 * GAP) // 3
    top = 2 * line_height(default_font())
    rows = frame[top:top + panel_w]
    colourful = rows.max(axis=-1) - rows.min(axis=-1) > 15  # grey EM is not
    em_panel = colourful[:, GAP:GAP + panel_w]
    truth_panel = colourful[:, 2 * GAP + panel_w:2 * GAP + 2 * panel_w]
    pred_panel = colourful[:, 3 * GAP + 2 * panel_w:3 * GAP + 3 * panel_w]
    assert em_panel.sum() == 0
    assert truth_panel.mean() > 0.5 and pred_panel.mean() > 0.5  # "cell" covers most of the crop


def test_plot_volumes_single_defaults_and_errors(demo_root, tmp_path):
    main = script_module("helpers/plot_volumes_single.py").main
    from torchtitan.data.crops.layout import DatasetError

    out = tmp_path / "crop4.gif"
    main(["--zarr", str(demo_root), "--crop", "crop4", "--out", str(out)])  # with an unknown slab
    with Image.open(out) as gif:
        assert gif.is_animated and gif.n_frames > 1
    with pytest.raises(DatasetError, match="available"):
        main(["--zarr", str(demo_root), "--crop", "crop99", "--out", str(tmp_path / "x.gif")])


def test_plot_volumes_grid_cli(demo_root, tmp_path):
    out = tmp_path / "grid.gif"
    _run("plot_volumes_grid.py", "--data", str(demo_root), "--crops", "crop1,crop4,jrc_synth-2/crop7",
         "--cols", "2", "--max_frames", "5", "--tile_px", "128", "--out", str(out))
    with Image.open(out) as gif:
        assert gif.is_animated and gif.n_frames == 5
        assert gif.width == 2 * (128 + GAP) + GAP

    main = script_module("helpers/plot_volumes_grid.py").main

    out_all = tmp_path / "all.gif"
    main(["--data", str(demo_root), "--classes", "mito,nuc", "--max_frames", "3", "--out", str(out_all)])
    with Image.open(out_all) as gif:
        assert gif.n_frames == 3
        assert gif.width == 4 * (256 + GAP) + GAP  # eight crops, four per row
