"""How many of the project's files one reads to follow a training step, a validation pass and
one training sample, measured by a line trace.

    python helpers/files_followed.py --data data/demo [--config train_configs/debug_segmentation_2d.toml]

It trains the config for two steps in this process (one rank, validation at step 2) with
``sys.settrace`` on during three phases: ``step`` is ``Trainer.train_step`` (forward, loss,
backward, clip, optimizer step; the second step, so that lazy first-step set-up is left out),
``validation`` is ``Trainer.validate``, ``sample`` is one ``__getitem__`` of the training
dataset (read from the store, targets, augmentation plan). For each phase it reports:

* **files**: the project's files (``torchtitan/``) in which at least :data:`MIN_LINES` distinct
  lines run, leaving out the model (``torchtitan/models/``: one reads it once, on its own) and
  the ground floor (``errors.py``, ``choices.py``: names, not steps). A dataclass constructor
  or a one-line accessor does not make a file one has to read;
* **folders**: the package folders those files lie in;
* **re-entries**: the distinct calls from one such file into another that the walk had
  entered before it: in the order in which the phase first enters its files, a call back to
  an earlier file (``samples -> grids``, then ``targets -> grids``) sends the reader back to a
  file already left. A walk whose calls only go on to new files has none.

PyTorch's, numpy's and zarr's code does not count. The README's architecture section gives
the table this prints (``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import contextlib
from pathlib import Path

import torchtitan

PACKAGE = Path(torchtitan.__file__).resolve().parent
REPO = PACKAGE.parent
MIN_LINES = 5
# Not counted: the model (read once, on its own) and the ground floor (names, not steps).
LEFT_OUT = ("torchtitan/models/", "torchtitan/errors.py", "torchtitan/choices.py")
PHASES = ("step", "validation", "sample")


class LineRecorder:
    """Records, while :meth:`phase` is active, the lines run in each project file and the
    calls between project files."""

    def __init__(self):
        self.lines: dict[str, dict[str, set[int]]] = {}
        self.calls: dict[str, list[tuple[str, str]]] = {}  # (caller file, callee file), in order
        self._phase: str | None = None
        self._prefix = str(PACKAGE)

    def _file(self, frame) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(self._prefix):
            return None
        return str(Path(path).relative_to(REPO))

    def _trace(self, frame, event, arg):
        if event != "call":
            return None
        here = self._file(frame)
        if here is None:
            return None  # not ours: its lines are not traced (ours it calls are)
        caller = frame.f_back
        while caller is not None and self._file(caller) is None:
            caller = caller.f_back  # through library frames (a hook, a dataclass __init__)
        if caller is not None and self._file(caller) != here:
            self.calls[self._phase].append((self._file(caller), here))
        lines = self.lines[self._phase].setdefault(here, set())

        def local(frame, event, arg):
            if event == "line":
                lines.add(frame.f_lineno)
            return local

        return local

    @contextlib.contextmanager
    def phase(self, name: str):
        if self._phase is not None:  # nested (a sample read inside validation): the outer counts
            yield
            return
        self._phase = name
        self.lines.setdefault(name, {})
        self.calls.setdefault(name, [])
        previous = sys.gettrace()
        sys.settrace(self._trace)
        try:
            yield
        finally:
            sys.settrace(previous)
            self._phase = None

    def measure(self, name: str) -> dict:
        """The phase's files, folders and re-entries (module docstring)."""
        files = sorted(f for f, lines in self.lines.get(name, {}).items()
                       if len(lines) >= MIN_LINES and not f.startswith(LEFT_OUT))
        counted = set(files)
        first: dict[str, int] = {}
        back: list[str] = []
        for caller, callee in self.calls.get(name, []):
            for f in (caller, callee):
                if f in counted:
                    first.setdefault(f, len(first))
            if caller in counted and callee in counted and first[callee] < first[caller]:
                if f"{caller} -> {callee}" not in back:
                    back.append(f"{caller} -> {callee}")
        folders = sorted({str(Path(f).parent) for f in files})
        return {"files": files, "folders": folders, "re_entries": back,
                "lines": {f: len(self.lines[name][f]) for f in files}}


def follow(data: Path, config: str) -> dict[str, dict]:
    """Run ``config`` for two steps on ``data`` and return each phase's measure
    (:meth:`LineRecorder.measure`)."""
    from torchtitan import trainer as trainer_module
    from torchtitan.tasks import SegmentationTask

    recorder = LineRecorder()
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
    return {name: recorder.measure(name) for name in PHASES}


def markdown(measures: dict[str, dict]) -> str:
    """The README's table: one row per phase."""
    rows = ["| followed | files | folders | re-entries |", "|---|---|---|---|"]
    for name in PHASES:
        m = measures[name]
        rows.append(f"| {name} | {len(m['files'])} | {len(m['folders'])} | "
                    f"{len(m['re_entries'])} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a CellMap-layout dataset (e.g. data/demo)")
    p.add_argument("--config", default="train_configs/debug_segmentation_2d.toml")
    p.add_argument("--json", action="store_true", help="print every measure as JSON")
    p.add_argument("--markdown", action="store_true", help="print the README's table")
    args = p.parse_args(argv)
    measures = follow(Path(args.data), args.config)
    if args.json:
        print(json.dumps(measures, indent=1))
        return 0
    if args.markdown:
        print(markdown(measures))
        return 0
    for name in PHASES:
        m = measures[name]
        print(f"{name}: {len(m['files'])} files in {len(m['folders'])} folders, "
              f"{len(m['re_entries'])} re-entries")
        for f in m["files"]:
            print(f"  {f} ({m['lines'][f]} lines run)")
        for r in m["re_entries"]:
            print(f"  back: {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
