"""Export a trained segmentation model: a bioimage.io package and a folder for a model hub.

    python helpers/export_model.py --checkpoint outputs/run/checkpoint --out exported/run \
        --authors "Ada Lovelace,Alan Turing" --license CC-BY-4.0 \
        --cite "Our paper|10.1234/abcd"
    python helpers/export_model.py --checkpoint run.pth --config outputs/run/config.toml \
        --out exported/run --format hub

``--out`` (a new folder) gets ``bioimageio/`` (``rdf.yaml``, TorchScript, ONNX and state-dict
weights, test tensors from a real crop of the training data, the model card and the resolved
config), ``bioimageio.zip`` (the same package zipped, for bioimage.io, ilastik, deepImageJ,
QuPath or napari) and ``hub/`` (``README.md`` model card, ``model.safetensors``,
``config.toml``). ``predict.py --model OUT/bioimageio`` (or the zip, or ``OUT/hub``) predicts
with an export as ``--checkpoint`` does with the checkpoint. See torchtitan/export/writer.py.
"""

import argparse
import sys

from torchtitan.errors import run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="DCP step folder, a run's checkpoint folder (latest step), or a .pth")
    p.add_argument("--config", help="the run's config.toml (default: found beside the checkpoint)")
    p.add_argument("--data", help="the training data, for the test window (default: the run's "
                                  "data.dataset_path)")
    p.add_argument("--out", required=True, help="a new folder for the export")
    p.add_argument("--format", default="bioimageio,hub",
                   help="comma-separated: bioimageio, hub (default: both)")
    p.add_argument("--name", default="", help="model name (default: from the run's dump folder)")
    p.add_argument("--description", default="", help="one line (default: job.description)")
    p.add_argument("--authors", default="", help="comma-separated author names")
    p.add_argument("--license", default="CC-BY-4.0", help="SPDX identifier (default CC-BY-4.0)")
    p.add_argument("--cite", action="append", default=[], metavar="TEXT|DOI_OR_URL",
                   help="a citation (repeatable), e.g. 'Our paper|10.1234/abcd'")
    p.add_argument("--training_data", default="",
                   help="what the model was trained on (default: the run's data path, classes "
                        "and voxel size)")
    p.add_argument("--intended_use", default="", help="for the model card")
    p.add_argument("--git_repo", default="", help="URL of the code's repository")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 17)")
    p.add_argument("--no-onnx", dest="onnx", action="store_false",
                   help="leave the ONNX weights out of the bioimage.io package")
    return p.parse_args(argv)


def card_of(args):
    from torchtitan.export.writer import Card, ExportError

    cites = []
    for entry in args.cite:
        text, sep, ref = entry.rpartition("|")
        if not sep or not text.strip() or not ref.strip():
            raise ExportError(f"--cite {entry!r}: expected 'TEXT|DOI_OR_URL', e.g. "
                              "'Our paper|10.1234/abcd'")
        cites.append((text.strip(), ref.strip()))
    return Card(name=args.name, description=args.description,
                authors=[a.strip() for a in args.authors.split(",") if a.strip()],
                license=args.license, cite=cites, training_data=args.training_data,
                intended_use=args.intended_use, git_repo=args.git_repo)


def main(argv=None) -> int:
    args = parse_args(argv)
    from torchtitan.export.writer import DEFAULT_OPSET, export_model

    written = export_model(args.checkpoint, args.out, config=args.config, data=args.data,
                           formats=tuple(f.strip() for f in args.format.split(",") if f.strip()),
                           card=card_of(args), opset=args.opset or DEFAULT_OPSET,
                           onnx=args.onnx)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
