"""Every shipped config runs as shipped (only sizes and paths reduced), and compiled blocks
see a fixed attention kernel whatever ``model.attention`` and activation checkpointing say.

Each file in ``train_configs/`` is picked up by itself. Configs without compile run in CI;
of the compiled (cluster) configs, ``demo_segmentation_2d`` runs in CI (compile + attention
"auto" + selective AC + bf16 + class balancing + augmentation), the others in the slow suite.
"""

from __future__ import annotations

import logging
import math
import subprocess
import tomllib

import pytest
import torch

from conftest import REPO, _env, read_jsonl, script_module

runner = script_module("bench/shipped_configs.py")  # the runner behind bash bench/gpu_smoke.sh
Reduction, command, debug_backbone = runner.Reduction, runner.command, runner.debug_backbone
entry_script, reduced_overrides, shipped_configs = (runner.entry_script, runner.reduced_overrides,
                                                    runner.shipped_configs)

CI_COMPILED = {"demo_segmentation_2d"}


def _marks(path):
    config = tomllib.loads(path.read_text())
    compiled = config.get("training", {}).get("compile", False)
    if compiled and path.stem not in CI_COMPILED:
        return [pytest.mark.slow]
    return []


CASES = [pytest.param(p, id=p.stem, marks=_marks(p)) for p in shipped_configs()]


def test_every_config_file_is_covered():
    names = {p.stem for p in shipped_configs()}
    assert len(names) >= 9 and CI_COMPILED <= names


@pytest.mark.distributed
@pytest.mark.parametrize("path", CASES)
def test_shipped_config_runs(path, demo_data, tmp_path, request):
    config = tomllib.loads(path.read_text())
    dump = tmp_path / "run"
    reduction = Reduction()
    data = request.getfixturevalue("neuron_data") if runner.needs_ids(config) else demo_data
    overrides = reduced_overrides(path, data, dump, 2, reduction)
    result = subprocess.run(command(path, overrides, 2), cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{path.name}: exit {result.returncode}\n{output[-6000:]}"

    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, reduction.steps + 1))
    assert all(math.isfinite(v) for v in losses.values())
    # The last step checkpoints whatever the shipped interval, and validates.
    ckpt = config.get("checkpoint", {})
    if ckpt.get("enable_checkpoint", True):
        assert (dump / "checkpoint" / f"step-{reduction.steps}" / ".metadata").is_file()
    if entry_script(config) == "train_segmentation.py":
        assert any("val/mean_iou" in r for r in records), records[-1]
    # The attention backend is chosen once per run, before compile, and said once.
    attention = config.get("model", {}).get("attention", "sdpa")
    if attention == "auto":
        assert output.count("attention='auto' on cpu: using sdpa") == 1, output[-4000:]


def test_debug_backbone_keeps_the_feed_forward_type():
    from torchtitan.models import BACKBONES

    for name, kw in BACKBONES.items():
        if kw["ffn_layer"] == "mlp":
            small = debug_backbone(name)
            assert BACKBONES[small]["ffn_layer"] == "mlp" and BACKBONES[small]["embed_dim"] <= 128
    for name in ("dinov3_vith16plus", "dinov3_vit7b16"):  # swiglu types: no debug size yet
        with pytest.raises(ValueError, match="ffn_layer"):
            debug_backbone(name)


def test_reduction_changes_only_sizes_and_paths(demo_data, tmp_path):
    """The flags a shipped config gets name only the keys the test may reduce."""
    allowed = {"--job.config_file", "--job.dump_folder", "--data.dataset_path", "--training.steps",
               "--training.batch_size", "--model.crop_size", "--data.num_workers",
               "--model.backbone", "--model.decoder_dim", "--model.decoder_num_heads",
               "--data.classes"}
    for path in shipped_configs():
        flags = [a for a in reduced_overrides(path, demo_data, tmp_path, 2) if a.startswith("--")]
        assert set(flags) <= allowed, (path.name, set(flags) - allowed)
        config = tomllib.loads(path.read_text())
        patch = config["model"].get("patch_size", 16)
        crop = reduced_overrides(path, demo_data, tmp_path, 2)
        crop = [int(c) for c in crop[crop.index("--model.crop_size") + 1].split(",")]
        assert all(c % patch == 0 and c >= patch for c in crop), (path.name, crop)


# ------------------------------------------------------- compile x attention x AC (in-process)
COMBOS = [(attention, ac) for attention in ("sdpa", "auto")
          for ac in ("none", "full", "selective:2", "selective:op")]


@pytest.mark.parametrize("attention,ac", COMBOS, ids=[f"{a}-{c}" for a, c in COMBOS])
def test_compiled_blocks_see_a_fixed_attention_backend(attention, ac):
    """The trainer's order on one process: resolve attention, then AC, then compile; the
    compiled model (fullgraph blocks) trains and matches the eager one."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models import build_backbone, resolve_attention_backend, use_attention
    from torchtitan.models.segmentation import SegmentationModel
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.parallelisms.parallelize import parallelize

    mode, _, option = ac.partition(":")
    cfg = ConfigManager().parse_args([
        "--model.attention", attention, "--training.compile", "true",
        "--activation_checkpoint.mode", mode,
        *(["--activation_checkpoint.selective_ac_option", option] if option else []),
    ])
    torch._dynamo.reset()

    def build():
        torch.manual_seed(0)
        backbone = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8,
                                  attention=attention)
        model = SegmentationModel(backbone, 3, head="linear", out_layers="four_even_intervals")
        model.init_weights()
        return model

    x = torch.randn(2, 1, 32, 32)
    eager = build()
    eager(x).square().mean().backward()

    model = build()
    use_attention(model, resolve_attention_backend(cfg.model.attention, "cpu"))
    assert all(b.attn.attention == "sdpa" for b in model.backbone.blocks)
    model = parallelize(model, ParallelDims(1, 1, 1, 1), None, cfg)
    out = model(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)
    wrappers = ("_orig_mod.", "_checkpoint_wrapped_module.")
    grads = {n: p.grad for n, p in model.named_parameters()}
    for wrapper in wrappers:
        grads = {n.replace(wrapper, ""): g for n, g in grads.items()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_gpu_smoke_dry_run_lists_every_cluster_config():
    """``bench/gpu_smoke.sh --dry-run`` prints one torchrun command per cluster config, each
    of which parses as a valid configuration."""
    from torchtitan.config.manager import ConfigManager

    result = subprocess.run(["bash", "bench/gpu_smoke.sh", "--dry-run", "--nproc", "4"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("DRY-RUN ")]
    cluster = sorted(p.name for p in shipped_configs() if p.stem.startswith("demo_"))
    assert [line.split()[1].rstrip(":") for line in lines] == cluster
    for line in lines:
        cmd = line.split(": ", 1)[1].split()
        assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
        script = next(i for i, a in enumerate(cmd) if a.endswith(".py") and "train_" in a)
        cfg = ConfigManager().parse_args(cmd[script + 1:])
        assert cfg.model.backbone == "dinov3_vits16"  # the ffn type kept, 64-wide heads
        assert cfg.training.compile and cfg.model.attention == "auto"
        assert cfg.training.steps == 3 and cfg.training.batch_size == 4


def test_per_op_selective_ac_without_compile_warns(caplog):
    """Per-op selective AC in eager mode dispatches every op through Python (3.3x slower on a
    GPU): the run says so and how to fix it; compiled, it says nothing."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models import build_backbone
    from torchtitan.models.segmentation import SegmentationModel
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.parallelisms.parallelize import parallelize

    def warnings_for(*flags: str) -> list[str]:
        cfg = ConfigManager().parse_args(["--activation_checkpoint.mode", "selective", *flags])
        backbone = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchtitan.parallelisms.parallelize"):
            parallelize(SegmentationModel(backbone, 3, head="linear"), ParallelDims(1, 1, 1, 1),
                        None, cfg)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    eager = warnings_for("--activation_checkpoint.selective_ac_option", "op",
                         "--training.compile", "false")
    assert any("selective_ac_option = 'op' without training.compile" in m for m in eager), eager
    assert not warnings_for("--activation_checkpoint.selective_ac_option", "2",
                            "--training.compile", "false")
