"""Device check of a GPU node that has no package registry: one command, about 9 minutes.

    bash bench/device_check.sh OUT                  # on the node: its python3 and its torch
    bash bench/device_check.sh OUT --dry-run        # every section on the CPU, toy sizes (< 2 min)
    bash bench/device_check.sh OUT --sections micro,vit --budget vit=300

GPU nodes are often air-gapped, with a Python that has torch, numpy, scipy, h5py,
scikit-image, tensorstore and timm but not zarr, tomli-w, cc3d, mwatershed, waterz and the
like. This script needs nothing from outside: ``bench/device_check.sh`` first runs
``--install OUT``, which installs what the node's Python lacks of :data:`WHEELS` from the
wheels in ``.wheels/`` (filled on a connected machine by ``bench/build_wheels.sh``) into
``OUT/site`` (``pip install --no-index --no-deps --target``), and then runs the check with
``OUT/site`` and the repository root on PYTHONPATH (the project is not installed on the node).
Nothing else is installed, no venv is made.

Sections, in order of value (``--sections``; each runs in its own process, under its own time
budget, ``--budget``; a row that would start past it says "skipped (budget)", and a section
that overruns is stopped, its unfinished rows saying so):

  env      Python, torch, CUDA, cuDNN, the GPU, FlashAttention-4 or why not; a bf16 GEMM's
           TFLOP/s and a device copy's GB/s, against the card's data-sheet peak.
  configs  every shipped ``train_configs/demo_*.toml`` for 3 steps with torchrun on every GPU
           (NCCL) as shipped -- bf16, compile, activation checkpointing, attention "auto" -- at
           the reduced size of ``bench/shipped_configs.py --backbone small``, on demo data made
           here.
  micro    the patch embedding as a Conv3d and as a GEMM on unfolded patches (forward +
           backward, ViT-L/16 at 256^3 x2), and attention at (2, 16, 4101, 64) bf16 with SDPA's
           flash, cuDNN and efficient kernels and FA4 (forward + backward; max error against a
           float32 reference).
  vit      the ViT-L/16 3D 256^3 x2 training step (segmentation, the trainer's BCE),
           eager and compiled, SDPA and FA4 (``bench/gpu.py``'s rows), each with a profile
           summary (GPU busy, kernels per step, top kernels); MFU against the data sheet and
           against the GEMM measured in env.
  mae      the encoder of ``train_configs/demo_mae.toml`` (model read from the TOML) as shipped
           (full AC, compile, bf16, its per-GPU batch on 8 nodes of 4 GPUs) and at settings
           that fill the GPU, with MFU.

Writes OUT/device_check.json (versions, GEMM and copy rates, every row with its status) and
OUT/device_check.txt (the table, printed last). ``--dry-run`` runs every section on the CPU at
toy sizes (gloo, no compile, one config) to show that the script works; its numbers mean
nothing.

This file imports only the standard library at the top: ``--install`` and ``--list-wheels``
run before the packages they provide exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS_DIR = REPO / ".wheels"

# What the code imports at run time that a GPU node's Python may lack: (distribution, import
# name), at the versions requirements.txt pins. FlashAttention-4 is not here: its wheels are
# far over the 64 MiB the folder may hold (bench/build_wheels.sh).
WHEELS = (
    ("zarr", "zarr"),
    ("numcodecs", "numcodecs"),
    ("donfig", "donfig"),                    # zarr's config
    ("google-crc32c", "google_crc32c"),      # zarr's checksums
    ("typing_extensions", "typing_extensions"),
    ("packaging", "packaging"),
    ("PyYAML", "yaml"),                      # donfig's
    ("tomli-w", "tomli_w"),
    ("connected-components-3d", "cc3d"),
    ("mwatershed", "mwatershed"),
    ("waterz", "waterz"),
    ("tqdm", "tqdm"),
    ("safetensors", "safetensors"),
    ("tensorboard", "tensorboard"),          # metrics.enable_tensorboard (default on)
    ("protobuf", "google.protobuf"),         # tensorboard's event files
    ("absl-py", "absl"),                     # tensorboard's
    ("six", "six"),                          # tensorboard's
)

SECTIONS = ("env", "configs", "micro", "vit", "mae")
# Seconds per section on a GPU (about 9 minutes in all) and in the dry run.
BUDGETS = {"env": 30, "configs": 150, "micro": 45, "vit": 180, "mae": 120}
DRY_BUDGETS = {"env": 15, "configs": 60, "micro": 15, "vit": 20, "mae": 20}
SKIPPED = "skipped (budget)"


# ----------------------------------------------------------------------------- wheels
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pinned_wheels() -> list[tuple[str, str, str]]:
    """(distribution, import name, version) of every entry of :data:`WHEELS`, the version
    as requirements.txt pins it."""
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_norm(name.split("[")[0])] = version.strip()
    missing = [d for d, _ in WHEELS if _norm(d) not in pins]
    if missing:
        raise SystemExit(f"device_check.py: no pin in requirements.txt for {', '.join(missing)}")
    return [(d, m, pins[_norm(d)]) for d, m in WHEELS]


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package ("google" of google.protobuf)
        return False


def _wheel_fits(path: Path) -> bool:
    """Whether a wheel's Python tag fits this interpreter (pure wheels always do)."""
    python_tag, abi_tag = path.name[:-4].split("-")[-3:-1]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    tags = python_tag.split(".")
    return any(t.startswith("py") for t in tags) or here in tags or (
        abi_tag == "abi3" and any(t.startswith("cp3") and int(t[3:]) <= sys.version_info.minor
                                  for t in tags))


def install(out: Path) -> dict:
    """Install into ``out/site`` the entries of :data:`WHEELS` this Python cannot import, from
    ``.wheels/``; returns (and writes to ``out/install.json``) what was done."""
    site = out / "site"
    record = {"site": str(site), "wheels_dir": str(WHEELS_DIR), "installed": [],
              "no_wheel": [], "method": None}
    wanted = [(d, m, v) for d, m, v in pinned_wheels() if not importable(m)]
    files = []
    available = {tuple(_norm(x) for x in p.name.split("-")[:2]): p
                 for p in WHEELS_DIR.glob("*.whl")} if WHEELS_DIR.is_dir() else {}
    for dist, module, version in wanted:
        wheel = available.get((_norm(dist), _norm(version)))
        if wheel is None:
            record["no_wheel"].append(f"{dist}=={version} ({module})")
        else:
            files.append(wheel)
            record["installed"].append(f"{dist}=={version}")
    if files:
        site.mkdir(parents=True, exist_ok=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
        if pip.returncode == 0:
            record["method"] = "pip install --no-index --no-deps --target"
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                            "--no-deps", "--upgrade", "--target", str(site),
                            *map(str, files)], check=True, stdout=sys.stderr)
        else:  # no pip on the node: a wheel is a zip of what goes into site-packages
            record["method"] = "unzip (no pip)"
            for wheel in files:
                if not _wheel_fits(wheel):
                    raise SystemExit(f"{wheel.name} is not for Python {sys.version.split()[0]}; "
                                     "rebuild .wheels with PY_VERSION=... bash bench/build_wheels.sh")
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(site)
    out.mkdir(parents=True, exist_ok=True)
    (out / "install.json").write_text(json.dumps(record, indent=1))
    for line in ([f"installed from .wheels into {site}: {', '.join(record['installed'])}"]
                 if record["installed"] else ["nothing to install from .wheels"]) + (
            [f"missing and not in .wheels: {', '.join(record['no_wheel'])}"]
            if record["no_wheel"] else []):
        print(line, file=sys.stderr)
    return record


# ----------------------------------------------------------------------------- rows
class Unavailable(Exception):
    """A row that cannot run here; its message says why."""


class Rows:
    """The rows of one section, appended to ``OUT/rows.jsonl`` as they finish (a section
    stopped at its budget keeps the rows it had), and the section's deadline."""

    def __init__(self, out: Path, section: str, deadline: float):
        self.path, self.section, self.deadline = out / "rows.jsonl", section, deadline

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"section": self.section, **record}, default=str) + "\n")

    def plan(self, names: list[str]) -> None:
        self._write({"plan": names})

    def info(self, **values) -> None:
        self._write({"info": values})

    def add(self, name: str, status: str, **metrics) -> None:
        self._write({"row": name, "status": status, **metrics})
        shown = ", ".join(f"{k}={v}" for k, v in metrics.items() if not k.startswith("_"))
        print(f"[{self.section}] {name}: {status}{' -- ' + shown if shown else ''}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def run(self, name: str, fn, *args, **kwargs) -> dict | None:
        """Run one row: ``fn`` returns its metrics, raises :class:`Unavailable` or fails."""
        if self.left() <= 0:
            self.add(name, SKIPPED)
            return None
        try:
            metrics = fn(*args, **kwargs) or {}
        except Unavailable as e:
            self.add(name, f"unavailable: {e}")
            return None
        except Exception as e:  # one row must not end the section
            self.add(name, f"failed: {type(e).__name__}: {e}"[:300])
            return None
        finally:
            _reset_compiler()
        self.add(name, "ok", **metrics)
        return metrics


def _reset_compiler() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sections
def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here (torch.cuda.is_available() is False); "
                         "use --dry-run to check the script on a CPU")
    return torch.device("cuda")


def section_env(rows: Rows, dry: bool, out: Path) -> None:
    import platform

    import torch

    import gpu
    from torchtitan.models.attention import fa4_unavailable_reason

    device = _device(dry)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fa4 = fa4_unavailable_reason(device)
    info = {"python": platform.python_version(), "executable": sys.executable,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "gpu": name, "gpus": torch.cuda.device_count(),
            "fa4": "available" if fa4 is None else fa4,
            "peak_bf16_tflops": gpu.peak_bf16_tflops(name) if device.type == "cuda" else None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(capability=f"sm{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    try:
        import flash_attn  # noqa: F401

        info["flash_attn"] = getattr(flash_attn, "__version__", "installed")
    except Exception:
        info["flash_attn"] = None
    rows.plan(["bf16 GEMM", "device copy"])
    rows.info(**info)
    n = 256 if dry else 8192
    gemm = rows.run("bf16 GEMM", lambda: {
        "size": f"{n}^3", "TFLOP/s": round(gpu.gemm_tflops(n, device, torch.bfloat16), 3)})
    if gemm:
        peak = info["peak_bf16_tflops"]
        rows.info(gemm_bf16_tflops=gemm["TFLOP/s"],
                  gemm_of_peak=f"{gemm['TFLOP/s'] / peak:.0%}" if peak else
                  ("n/a (CPU)" if dry else f"unknown card {name!r}: no data-sheet peak"))
    size = 2**24 if dry else 2**31
    copy = rows.run("device copy", lambda: {
        "MiB": size >> 20, "GB/s": round(gpu.copy_gbps(size, device), 1)})
    if copy:
        rows.info(copy_gb_s=copy["GB/s"])


def section_configs(rows: Rows, dry: bool, out: Path) -> None:
    import shipped_configs as sc
    import torch

    from torchtitan.demo.data import generate_demo_data

    configs = sorted(sc.CONFIGS.glob("demo_*.toml"))
    if dry:  # one config, uncompiled: a CPU compiles a block in about a minute
        configs = configs[-1:]
    rows.plan([p.name for p in configs])
    nproc = torch.cuda.device_count() or 2
    data = out / "data" / "demo"
    if not data.exists():
        generate_demo_data(data, seed=0, scale=0.5)
    reduction = sc.Reduction(backbone="debug" if dry else "small", steps=2 if dry else 3)
    extra = ["--training.compile", "false"] if dry else []

    def run(path: Path) -> dict:
        timeout = max(10.0, rows.left())
        ok, seconds, tail = sc.run_config(path, sc.config_data(path, data, out / "data" / "neurons"),
                                          out / "runs" / path.stem, nproc, reduction, timeout,
                                          extra)
        if not ok:
            lines = [ln for ln in tail.splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error" in ln]
            raise RuntimeError((errors or lines or ["no output"])[-1].strip()[:250])
        return {"s": round(seconds), "processes": nproc,
                "backend": "nccl" if torch.cuda.is_available() else "gloo",
                "backbone": reduction.backbone}

    for path in configs:
        rows.run(path.name, run, path)


def section_micro(rows: Rows, dry: bool, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import gpu
    from torchtitan.models.attention import attention
    from torchtitan.models.vit import unfold_patches

    device = _device(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    B, D, edge, p = (2, 64, 32, 8) if dry else (2, 1024, 256, 16)
    qkv_shape = (1, 2, 37, 16) if dry else (2, 16, 4101, 64)
    backends = [("SDPA math", SDPBackend.MATH)] if dry else []
    backends += [("SDPA flash", SDPBackend.FLASH_ATTENTION),
                 ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                 ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)]
    names = ["patch embed Conv3d", "patch embed GEMM"] + [n for n, _ in backends] + ["FA4"]
    rows.plan(names)
    reps = 2 if dry else 10

    def timed(fn) -> float:
        fn()
        gpu.sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        gpu.sync(device)
        return (time.perf_counter() - t0) / reps * 1e3  # ms

    torch.manual_seed(0)
    x = torch.randn(B, 1, edge, edge, edge, device=device)
    weight = (torch.randn(D, 1, p, p, p, device=device) * 0.02).requires_grad_()
    bias = torch.zeros(D, device=device, requires_grad=True)
    ref_tokens = F.conv3d(x, weight, bias, stride=p).flatten(2).transpose(1, 2)

    def patch(kind: str) -> dict:
        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not dry):
                if kind == "conv":
                    y = F.conv3d(x, weight, bias, stride=p).flatten(2).transpose(1, 2)
                else:
                    y = F.linear(unfold_patches(x, p), weight.flatten(1), bias)
            y.float().square().mean().backward()
            return y
        ms = timed(step)
        err = (step().float() - ref_tokens).abs().max().item()
        return {"shape": f"{B}x1x{edge}^3 -> {D}, patch {p}", "ms fwd+bwd": round(ms, 3),
                "max abs diff vs fp32 conv": f"{err:.1e}"}

    rows.run("patch embed Conv3d", patch, "conv")
    rows.run("patch embed GEMM", patch, "gemm")

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*qkv_shape, device=device, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v))).float() \
        if dry else _sdpa_math_fp32(q, k, v)
    Bq, H, N, hd = qkv_shape
    flops = 4 * Bq * H * N * N * hd * 3.5  # forward 4BHN^2d, backward 2.5 times that

    def attn(fn) -> dict:
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))

        def step():
            o = fn(qq, kk, vv)
            o.float().sum().backward()
            return o
        ms = timed(step)
        err = (step().float() - ref).abs().max().item()
        return {"shape": "x".join(map(str, qkv_shape)), "dtype": str(dtype).split(".")[-1],
                "ms fwd+bwd": round(ms, 3), "TFLOP/s": round(flops / ms / 1e9, 1),
                "max abs err vs fp32": f"{err:.1e}"}

    for name, backend in backends:
        if device.type != "cuda" and backend != SDPBackend.MATH:
            rows.run(name, _unavailable, "needs a CUDA GPU (this is a CPU dry run)")
            continue

        def sdpa(a, b, c, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c)
        rows.run(name, attn, sdpa)
    why = gpu.attention_status("fa4", device)
    if why:
        rows.run("FA4", _unavailable, why)
    else:
        rows.run("FA4", attn, lambda a, b, c: attention(a, b, c, "fa4"))


def _sdpa_math_fp32(q, k, v):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def _unavailable(why: str) -> dict:
    raise Unavailable(why)


def _peaks(out: Path) -> tuple[float | None, float]:
    """The data-sheet peak and the GEMM rate the env section measured (or a fresh GEMM)."""
    info = read_results(out)["info"]
    return info.get("peak_bf16_tflops"), info.get("gemm_bf16_tflops") or 0.0


def _train_row(rows: Rows, name: str, device, sizes, gemm, peak, dry: bool, **kw) -> None:
    import gpu

    def run() -> dict:
        row = gpu.run_train(sizes=sizes, device=device, peak_gemm=gemm or float("nan"),
                            peak_spec=peak, profile=name, profile_n=1 if dry else 3, **kw)
        row.pop("_samples_per_s")
        return {k: v for k, v in row.items() if v is not None}
    rows.run(name, run)


def section_vit(rows: Rows, dry: bool, out: Path) -> None:
    import dataclasses

    import gpu

    device = _device(dry)
    peak, gemm = _peaks(out)
    sizes = dataclasses.replace(gpu.DRY if dry else gpu.FULL, steps=2 if dry else 3)
    crop, batch = (32, 2) if dry else (256, 2)
    plan = []
    for attention in ("sdpa", "fa4"):
        for compile_ in (False, True):
            plan.append((f"{'toy ViT' if dry else 'ViT-L/16'} seg bce {crop}^3 x{batch}, {attention}, "
                         f"{'compiled' if compile_ else 'eager'}", attention, compile_))
    rows.plan([p[0] for p in plan])
    for name, attention, compile_ in plan:
        why = gpu.attention_status(attention, device)
        if why is None and compile_ and dry:
            why = "--dry-run does not compile (minutes on a CPU)"
        if why:
            rows.run(name, _unavailable, why)
            continue
        _train_row(rows, name, device, sizes, gemm, peak, dry, kind="seg bce", crop=crop,
                   batch=batch, ratio=None, attention=attention, compile_=compile_, ac=False)


def section_mae(rows: Rows, dry: bool, out: Path) -> None:
    import dataclasses

    import gpu

    device = _device(dry)
    peak, gemm = _peaks(out)
    toml = tomllib.loads((REPO / "train_configs" / "demo_mae.toml").read_text())
    m, t = toml["model"], toml["training"]
    shipped_ac = toml.get("activation_checkpoint", {}).get("mode", "none")
    # The shipped global batch over train_mae.sh's example: 8 nodes of 4 GPUs. The encoder
    # sees a quarter of the patches (mask ratio 0.75): larger batches are needed to fill a GPU.
    shipped_batch = max(1, t["batch_size"] // 32)
    mae = {"decoder_dim": m["decoder_dim"], "decoder_depth": m["decoder_depth"],
           "decoder_num_heads": m["decoder_num_heads"], "norm_pix_loss": m["norm_pix_loss"]}
    sizes = dataclasses.replace(gpu.DRY if dry else gpu.FULL, steps=2 if dry else 3,
                                warmup=1)
    crop = 32 if dry else m["crop_size"][0]
    if dry:
        mae.update(decoder_dim=32, decoder_depth=1, decoder_num_heads=2)
    attention = "fa4" if gpu.attention_status("fa4", device) is None else "sdpa"
    compile_ = t.get("compile", False) and not dry
    settings = [(f"as shipped: {shipped_ac} AC, batch {shipped_batch}", shipped_ac,
                 shipped_batch)]
    settings += [(f"filling: selective per-op AC, batch {b}", True, b)
                 for b in ((2,) if dry else (32, 64))]
    settings += [(f"filling: no AC, batch {b}", "none", b) for b in (() if dry else (32,))]
    names = [f"{m['backbone']} MAE {crop}^3 {m['mask_ratio']}, {attention}"
             f"{', compiled' if compile_ else ''}, {label}" for label, _, _ in settings]
    rows.plan(names)
    for name, (_, ac, batch) in zip(names, settings):
        model = None

        def build(ac=ac):
            return gpu.build_model("mae", sizes, attention, compile_,
                                   False if ac == "none" else ac, device,
                                   backbone=m["backbone"], mae=mae)
        try:
            model = build() if rows.left() > 0 else None
        except Exception as e:
            rows.add(name, f"failed: {type(e).__name__}: {e}"[:300])
            continue
        _train_row(rows, name, device, sizes, gemm, peak, dry, kind="mae", crop=crop, batch=batch,
                   ratio=m["mask_ratio"], attention=attention, compile_=compile_, ac=ac,
                   model=model)
        del model


SECTION_FUNCS = {"env": section_env, "configs": section_configs, "micro": section_micro,
                 "vit": section_vit, "mae": section_mae}


# ----------------------------------------------------------------------------- report
def read_results(out: Path) -> dict:
    """The rows, plans and info written so far, by section."""
    result = {"info": {}, "plans": {}, "rows": []}
    path = out / "rows.jsonl"
    if not path.exists():
        return result
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "info" in record:
            result["info"].update(record["info"])
        elif "plan" in record:
            result["plans"][record["section"]] = record["plan"]
        else:
            result["rows"].append(record)
    return result


def _cells(row: dict) -> str:
    shown = []
    for k, v in row.items():
        if k in ("section", "row", "status") or k.startswith("_"):
            continue
        shown.append(f"{k} {v}")
    text = "; ".join(shown)
    profile = row.get("_profile")
    if profile:
        top = ", ".join(f"{t['name'][:40]} {t['share']}" for t in profile["top_kernels"][:3])
        text += (f"; GPU busy {profile['gpu_busy']}, {profile['kernels_per_step']} kernels/step"
                 + (f"; top: {top}" if top else ""))
    return text


def write_report(out: Path, sections: dict, installed: dict | None, dry: bool) -> str:
    res = read_results(out)
    rows = res["rows"]
    for section, state in sections.items():  # planned rows that never reported
        done = {r["row"] for r in rows if r["section"] == section}
        for name in res["plans"].get(section, []):
            if name not in done:
                status = SKIPPED if state.get("timed_out") else \
                    f"not run: section ended with exit code {state.get('exit')}"
                rows.append({"section": section, "row": name, "status": status})
        if not res["plans"].get(section):  # the section died before it planned
            if state.get("exit") not in (0, None) or state.get("timed_out"):
                rows.append({"section": section, "row": "(section)",
                             "status": SKIPPED if state.get("timed_out") else
                             f"failed: exit code {state.get('exit')}: {state.get('error', '')}"})
    info = res["info"]
    order = {s: i for i, s in enumerate(SECTIONS)}
    rows.sort(key=lambda r: order[r["section"]])  # stable: each section's own order kept
    report = {**info, "dry_run": dry, "wheels": installed, "sections": sections, "rows": rows}
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))

    head = (f"device check{' (dry run, CPU: the numbers mean nothing)' if dry else ''}: "
            f"{info.get('gpu', '?')} {info.get('capability', '')}, python {info.get('python')}, "
            f"torch {info.get('torch')} (CUDA {info.get('cuda')}, cuDNN {info.get('cudnn')}), "
            f"FA4: {info.get('fa4')}\n"
            f"bf16 GEMM {info.get('gemm_bf16_tflops')} TFLOP/s (data-sheet peak "
            f"{info.get('peak_bf16_tflops')}: {info.get('gemm_of_peak')}), device copy "
            f"{info.get('copy_gb_s')} GB/s")
    if installed:
        head += (f"\nfrom .wheels: {', '.join(installed['installed']) or 'nothing needed'}"
                 + (f"; missing without a wheel: {', '.join(installed['no_wheel'])}"
                    if installed["no_wheel"] else ""))
    width = max([len(r["row"]) for r in rows] + [3])
    lines = [head, "", f"{'section':8} | {'row':{width}} | status | result"]
    for r in rows:
        lines.append(f"{r['section']:8} | {r['row']:{width}} | {r['status']} | {_cells(r)}")
    text = "\n".join(lines) + "\n"
    (out / "device_check.txt").write_text(text)
    return text


# ----------------------------------------------------------------------------- main
def run_sections(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").unlink(missing_ok=True)
    budgets = dict(DRY_BUDGETS if args.dry_run else BUDGETS)
    for item in args.budget:
        key, _, seconds = item.partition("=")
        if key not in budgets or not seconds:
            raise SystemExit(f"--budget {item!r}: expected SECTION=SECONDS, SECTION one of "
                             f"{', '.join(SECTIONS)}")
        budgets[key] = float(seconds)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; expected some of {', '.join(SECTIONS)}")
    installed_path = out / "install.json"
    installed = json.loads(installed_path.read_text()) if installed_path.exists() else None
    states = {}
    for section in SECTIONS:
        if section not in sections:
            continue
        budget = budgets[section]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", section,
               "--out", str(out), "--until", str(time.time() + budget)]
        if args.dry_run:
            cmd.append("--dry-run")
        t0 = time.perf_counter()
        print(f"== {section} (budget {budget:.0f} s)", flush=True)
        state = {"budget_s": budget}
        # The section gets its budget and a grace period to finish the row it is in; past
        # that it is stopped (its finished rows stay in rows.jsonl).
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=budget + 30 + (0 if args.dry_run else 60),
                                  stderr=subprocess.PIPE, text=True)
            state["exit"] = proc.returncode
            sys.stderr.write(proc.stderr[-4000:])
            if proc.returncode:
                lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
                state["error"] = lines[-1][:300] if lines else ""
        except subprocess.TimeoutExpired:
            state["timed_out"] = True
        state["seconds"] = round(time.perf_counter() - t0, 1)
        states[section] = state
    text = write_report(out, states, installed, args.dry_run)
    print("\n" + text, end="")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for device_check.json/.txt and the runs")
    p.add_argument("--dry-run", action="store_true",
                   help="every section on the CPU at toy sizes (a test that the script runs)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)} (default all; env gives "
                        "the GEMM rate that MFU is also measured against)")
    p.add_argument("--budget", nargs="*", default=[], metavar="SECTION=SECONDS",
                   help=f"seconds per section (default {BUDGETS}; dry run {DRY_BUDGETS})")
    p.add_argument("--install", type=Path, metavar="OUT",
                   help="install what this Python lacks from .wheels into OUT/site and print "
                        "OUT/site (bench/device_check.sh runs this first)")
    p.add_argument("--list-wheels", action="store_true",
                   help="print the pinned distributions (bench/build_wheels.sh downloads them)")
    p.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list_wheels:
        print("\n".join(f"{d}=={v}" for d, _, v in pinned_wheels()))
        return 0
    if args.install:
        install(args.install.resolve())
        print(args.install.resolve() / "site")
        return 0
    if args.out is None:
        p.error("--out is required")
    if args.child:
        SECTION_FUNCS[args.child](Rows(args.out, args.child, args.until), args.dry_run, args.out)
        return 0
    return run_sections(args)


if __name__ == "__main__":
    sys.exit(main())
