"""How many of the project's files one reads to follow a training step, a validation pass and
one training sample: the files whose code runs while each of them runs.

    python helpers/files_followed.py --data data/demo [--config train_configs/debug_segmentation_2d.toml]

It trains the config for two steps in this process (one rank, validation at step 2) with a
profiler on: a file counts for a phase when a function defined in it is called during that
phase. Phases: ``step`` is ``Trainer.train_step`` (forward, loss, backward, clip, optimizer
step; the second step, so that lazy first-step set-up is left out), ``validation`` is
``Trainer.validate``, ``sample`` is one ``__getitem__`` of the training dataset (read from the
store, targets, augmentation plan). Files are the project's (``torchtitan/``, the entry script)
and its dataclass-generated methods count for the file of their class; PyTorch's, numpy's and
zarr's do not count. The README's architecture section gives the counts this prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torchtitan

PACKAGE = Path(torchtitan.__file__).resolve().parent
REPO = PACKAGE.parent


class FileRecorder:
    """Records the project files whose functions are called while :meth:`phase` is active."""

    def __init__(self):
        self.files: dict[str, set[str]] = {}
        self._phase: str | None = None
        self._seen: int = 0  # calls of the active phase (a phase may run more than once)

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(str(PACKAGE)):
            self.files[self._phase].add(str(Path(path).relative_to(REPO)))

    @contextlib.contextmanager
    def phase(self, name: str):
        if self._phase is not None:  # nested (a sample read inside validation): the outer counts
            yield
            return
        self._phase = name
        self.files.setdefault(name, set())
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            self._phase = None


def follow(data: Path, config: str) -> dict[str, list[str]]:
    """Run ``config`` for two steps on ``data`` and return the files of each phase."""
    from torchtitan import trainer as trainer_module
    from torchtitan.tasks import SegmentationTask

    recorder = FileRecorder()
    train_step, validate = trainer_module.Trainer.train_step, trainer_module.Trainer.validate

    def recorded_step(self, batch, step):
        if step != 2:
            return train_step(self, batch, step)
        with recorder.phase("step"):
            return train_step(self, batch, step)

    def recorded_validate(self, step):
        with recorder.phase("validation"):
            return validate(self, step)

    trainer_module.Trainer.train_step = recorded_step
    trainer_module.Trainer.validate = recorded_validate
    sampled = []

    def make_task(cfg):
        task = SegmentationTask(cfg)

        def train_dataset(*a, **k):
            ds = SegmentationTask.train_dataset(task, *a, **k)
            if not sampled:
                with recorder.phase("sample"):
                    ds[0]
                sampled.append(True)
            return ds

        task.train_dataset = train_dataset
        return task

    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", config, "--data.dataset_path", str(data),
                "--job.dump_folder", dump, "--training.steps", "2", "--metrics.eval_freq", "2",
                "--checkpoint.enable_checkpoint", "false",
                "--no-metrics.progress_bar",
                "--training.data_parallel_shard_degree", "1", "--data.num_workers", "0"]
        try:
            code = trainer_module.run(make_task, argv)
        finally:
            trainer_module.Trainer.train_step = train_step
            trainer_module.Trainer.validate = validate
    if code != 0:
        raise SystemExit(f"the run exited {code}")
    return {k: sorted(v) for k, v in recorder.files.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a CellMap-layout dataset (e.g. data/demo)")
    p.add_argument("--config", default="train_configs/debug_segmentation_2d.toml")
    p.add_argument("--json", action="store_true", help="print the file lists as JSON")
    args = p.parse_args(argv)
    files = follow(Path(args.data), args.config)
    if args.json:
        print(json.dumps(files, indent=1))
        return 0
    for name in ("step", "validation", "sample"):
        print(f"{name}: {len(files.get(name, []))} files")
        for f in files.get(name, []):
            print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
